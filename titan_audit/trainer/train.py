"""The train loop: a trajectory that is bitwise the same at every world size W dividing V.

    result = train(config, "runs/a")                       # this process's rank of the group
    result = train(config, "runs/a", resume=True)          # continue from the latest checkpoint
    result = train(config, "runs/b", init="hf/qwen3")      # start from an HF directory (or a run)

The run engine (trainer/run.py, trainer/step.py) does what every run does (process group, numerics, rank-0
checks, run lock, manifest, recorder, reduction, clipping, AdamW, checkpoints, close on any
exception); this file says what is the train loop's own: where the microbatches come from (the
elastic loader) and what their loss is. Read top to bottom, a step is (rank r of W, V virtual
microbatches):
  1. microbatches [r*V/W, (r+1)*V/W) of the global batch, in index order (data/ElasticLoader);
  2. per microbatch: forward, loss = sum(masked token CE) / global_loss_tokens (+ for an MoE model
     router_aux_loss_coef * aux / V, aux = the microbatch's load-balancing loss), backward, the
     gradients flattened into one fp32 vector and added to the TreeReducer under the microbatch's
     global index;
  3. the reducer's all_reduce: a fixed binary tree over the V microbatch gradients, the same bits
     on every rank and for every W (reduce.py); never a plain all_reduce in deterministic mode;
  4. grad-norm clipping on that full vector (identical on every rank, so identical clipping);
     each parameter's .grad is its slice of the vector (DP) or this rank's dim-0 shard of it
     (FSDP2, `parallel.mode = "fsdp"`, fsdp.py: FSDP's own reduce-scatter is off);
  5. AdamW (elementwise: the update does not depend on the layout or the sharding);
  6. the step loss for logging: the V per-microbatch losses gathered in index order and summed
     with the same tree, so it does not depend on W either; for an MoE model the aux losses ride
     along in the same gather and tree (metric `aux_loss` = their tree sum / V);
  7. audit records (data and loss under the global microbatch index; grads, params, optimizer
     state at step level), a metrics row, a progress line on rank 0 (stderr: stdout stays free for --json);
  8. every `checkpoint.interval` steps: a verified checkpoint (reshardable DCP + a rank-agnostic
     blob with the loader state and step) and an audit flush.
Steps are numbered from 1; checkpoint `step_N` holds the state after N steps.

Init (`--init`): the weights before step 1 are another run's latest checkpoint or an HF
directory's (trainer/init.py: preflighted, each rank loading only the pieces it holds, bitwise,
their digest in the manifest); optimizer state, data order and schedule start fresh. Tensor parallelism
(`parallel.tp`, tensor_parallel.py): r, W above are the dp rank and size; TP peers share them.

MoE auxiliary loss, why it keeps G3: a microbatch's aux loss is computed from its own tokens
(moe.py: per-expert sums over the microbatch, fixed shape, fixed thread count), so its bits do not
depend on W; it enters that microbatch's objective with the weight coef / V, V fixed by the global
batch plan (never W or a rank-local count), so the microbatch's gradient is W-independent and the
fixed tree sums it like any other. The logged value is gathered in index order and tree-summed.

Compute dtype (`model.compute_dtype = "bfloat16"`): the forward/backward run on bf16 casts of the
fp32 parameters (transformer.py `set_compute_dtype`; under FSDP2 its MixedPrecisionPolicy with
param_dtype bf16, which casts the same elements the same way), the loss is float32 (logits are
widened before the log-softmax), each microbatch's gradient reaches the tree reducer as fp32 (the
cast's backward widens the bf16 gradient exactly), and clipping, AdamW and its state, checkpoints
and the audited parameters are fp32 master weights. Every cast is elementwise and every bf16
kernel runs on one microbatch with the config's thread count, so G1/G3/G5 hold as in fp32.

Device (`parallel.device = "cuda"`, run.py): each rank allocates its pieces of the model there
(materialize.py) and writes into them weights computed or read on the CPU (the CPU's bits); each
microbatch goes there after its data records (hashed on the CPU).

Guarantees: G1 (same config + fingerprint -> same audit hashes), G3 (same hashes for every W
dividing V, and across a resume at another W), G5 (SIGKILL at any moment, `resume=True` -> the
same trajectory). The intra-op thread count is set from `parallel.threads` on every rank before
any compute, whatever OMP_NUM_THREADS the launcher exported. With `determinism.enabled = false`
the loop is a conventional trainer (gradients accumulated in .grad, one plain all_reduce; under
FSDP2 its own reduce-scatter): the baseline of `bench train` and the negative control of the
invariance tests. DP, FSDP2 and (in BI mode) TP give the same bits as each other, at every W."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_audit.audit import op_log
from titan_audit.data import ElasticLoader, LoaderConfig, LoaderState
from titan_audit.models import token_logprobs
from titan_audit.trainer.config import TrainConfig
from titan_audit.trainer.launch.spec import LaunchOptions
from titan_audit.trainer.materialize import build_model
from titan_audit.trainer.optim import build_optimizer
from titan_audit.trainer.reduce import tree_sum
from titan_audit.trainer.run import Run
from titan_audit.trainer.step import StepKit
from titan_audit.trainer.train_job import TrainJob
from titan_audit.trainer.until import Stopper


@dataclass
class TrainResult:
    run_dir: Path
    world_size: int
    start_step: int  # steps already done when this process started (0 for a fresh run)
    last_step: int
    losses: list[float]  # step losses of the steps run here


# ---------------------------------------------------------------------------------- the loss
def microbatch_loss(model: torch.nn.Module, mb, *, with_aux: bool = False):
    """sum over the microbatch's loss tokens of -log p(target), over the GLOBAL batch's loss tokens
    (float32: the logits are widened before the log-softmax, whatever the compute dtype).
    with_aux: (that loss, the MoE load-balancing loss of this microbatch's tokens)."""
    if with_aux:
        logits, aux = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids, return_aux_loss=True)
    else:
        logits = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids)
    nll = -token_logprobs(logits, mb.targets)
    loss = (nll * mb.loss_mask).sum() / mb.global_loss_tokens
    return (loss, aux) if with_aux else loss


def _forward_backward(kit: StepKit, model: torch.nn.Module, mb, aux_scale: float | None) -> torch.Tensor:
    """A microbatch's forward, records and backward into its gradient; [loss] or [loss, aux]."""
    recorder = kit.run.recorder
    with kit.microbatch(mb.index):
        recorder.record_data(mb.tensors())  # the loader's CPU tensors: hashed without a copy
        mb = mb.to(kit.run.mesh.device)  # batch, targets, positions, loss mask: on the run's device
        if aux_scale is None:
            loss = objective = microbatch_loss(model, mb)
            recorder.record_loss(loss)
            figures = loss.detach().reshape(1)
        else:  # MoE: the load-balancing loss rides along with weight coef / V (fixed by the batch)
            loss, aux = microbatch_loss(model, mb, with_aux=True)
            recorder.record_loss(loss)
            recorder.record_loss(aux, name="aux_loss")
            objective = loss + aux * aux_scale if aux_scale else loss
            figures = torch.stack([loss.detach(), aux.detach()])
        objective.backward()
    return figures


# ---------------------------------------------------------------------------------- the loop
def train(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool | str = False,
    stop_at: int | None = None,
    quiet: bool = False,
    oplog_step: int | None = None,
    init: str | os.PathLike | None = None,
    until: str | None = None,
    audit_verified: dict[str, list[int | str]] | None = None,
) -> TrainResult:
    """Run (or resume) a training run into `out` on this process's rank of the current group.

    stop_at: stop after this step (<= config.steps) without changing the schedule (replay
    --verify-to); the last step always gets a checkpoint. oplog_step: record that step's
    forward, backward, reduction and optimizer update as an op log, out/oplogs/step_N.parquet
    (audit.oplog; what `titan-audit bisect --step N` compares). init: another run's directory or
    an HF model directory to start from (trainer/init.py); a resume needs none. until: stop at a
    skill level, e.g. "reward>=0.24" (trainer/until.py: evaluated every N steps, recorded).
    audit_verified: the audit-log parts a launcher's check verified (LaunchOptions), not read again.
    """
    stopper = Stopper(until)
    options = LaunchOptions(
        resume=resume,
        overwrite=overwrite,
        init=None if init is None else str(init),
        stop_at=stop_at,
        quiet=quiet,
        until=until,
        audit_verified=audit_verified,
    )
    run = Run(config, out, job=TRAIN_JOB, options=options, single_group=config.parallel.mode == "fsdp")
    with run:
        W = run.mesh.world_size
        if oplog_step is not None and W != 1:
            raise ValueError(f"an op log is recorded on one rank; this run has {W}")
        model, sharded = build_model(config, run)  # each rank allocates and fills what it holds
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, config.optimizer, portable=config.determinism.batch_invariant)
        blob = run.restore(model, optimizer)
        stopper.start(run, blob)  # a resume: the recorded condition; a run that stopped is refused
        loader = run.closing(_loader(config, run, blob))
        run.begin(model, optimizer)

        kit = StepKit(run, params, optimizer, sharded)
        V = loader.num_microbatches
        assert V == config.num_microbatches, (V, config.num_microbatches)
        with_aux = config.model.model_config().is_moe  # the aux loss is logged for every MoE model
        aux_scale = config.model.router_aux_loss_coef / V if with_aux else None  # fixed by the batch, never by W
        tokens = config.data.global_batch_size * config.data.seq_len
        losses: list[float] = []
        batches = loader.steps()
        for step in stopper.steps(run):  # run.steps(), ended at the step where --until holds
            t0 = time.perf_counter()
            lr = kit.start(step)
            microbatches = next(batches)
            # step `oplog_step` (bisect --step) runs under DebugMode: every aten op hashed, in order
            with op_log(run.out, f"step_{step}") if step == oplog_step else contextlib.nullcontext():
                # popped: each microbatch's tensors are freed once its backward is done
                figures = [
                    _forward_backward(kit, model, microbatches.pop(0), aux_scale) for _ in range(len(microbatches))
                ]
                grad_norm = kit.finish()
            # [V, 1 or 2]: loss (and aux) of every microbatch in index order, summed by the fixed tree
            step_sums = tree_sum(kit.gather_in_index_order(torch.stack(figures)))
            losses.append(float(step_sums[0]))
            seconds = time.perf_counter() - t0
            row = {"step": step, "loss": losses[-1]}
            row |= {"aux_loss": float(step_sums[1]) / V} if with_aux else {}  # mean per microbatch
            row |= {"grad_norm": grad_norm, "lr": lr, "tokens": tokens, "seconds": seconds, "world_size": W}
            row |= stopper.after_step(run, step, model)  # evaluated when due; a stop makes `step` the last
            line = (
                f"step {step}/{run.last_step}  loss {losses[-1]:.4f}  grad_norm {grad_norm:.3f}  "
                f"lr {lr:.2e}  {tokens / seconds:,.0f} tok/s  {run.mesh.describe()}"
            )
            run.end_step(step, row, line, lambda: {"loader": loader.state().to_dict()} | stopper.blob())
        return TrainResult(run.out, W, run.start_step, run.last_step, losses)


def _loader(config: TrainConfig, run: Run, blob: dict | None) -> ElasticLoader:
    """This rank's elastic loader, at the resumed position when `blob` (a checkpoint's) is given."""
    state = None
    if blob is not None:
        state = LoaderState.from_dict(blob["loader"], source=str(run.checkpointer.path(run.start_step)))
    store = config.data.store if config.data.store is not None else str(run.out / "data" / "tasks.zarr")
    same = ("seq_len", "global_batch_size", "microbatch_size", "packing", "workers")  # data.* keys as they are
    loader_config = LoaderConfig(store=store, seed=config.seed, **{k: getattr(config.data, k) for k in same})
    interleaved = config.parallel.mode == "fsdp" and config.determinism.enabled  # fsdp.py: round k = k*W + r
    rank, dp = run.mesh.dp_rank, run.mesh.dp  # TP peers read the same microbatches
    return ElasticLoader(loader_config, rank=rank, world_size=dp, state=state, interleaved=interleaved)


TRAIN_JOB = TrainJob(train)  # what `titan-audit train` launches (trainer/launch)
