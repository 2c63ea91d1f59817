"""The train loop: a trajectory that is bitwise the same at every world size W dividing V.

    result = train(config, "runs/a")                       # this process's rank of the group
    result = train(config, "runs/a", resume=True)          # continue from the latest checkpoint

Read top to bottom, a step is (rank r of W, V virtual microbatches):
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

Guarantees: G1 (same config + fingerprint -> same audit hashes), G3 (same hashes for every W
dividing V, and across a resume at another W), G5 (SIGKILL at any moment, `resume=True` -> the
same trajectory). The intra-op thread count is set from `parallel.threads` on every rank before
any compute, whatever OMP_NUM_THREADS the launcher exported. With `determinism.enabled = false`
the loop is a conventional trainer (gradients accumulated in .grad, one plain all_reduce; under
FSDP2 its own reduce-scatter): the baseline of `bench train` and the negative control of the
invariance tests. DP and FSDP2 give the same bits as each other, at every W.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titan_audit import deterministic
from titan_audit.audit import Recorder, op_log
from titan_audit.audit.run_manifest import record_census
from titan_audit.batch_invariant import census
from titan_audit.data import ElasticLoader, LoaderConfig, LoaderState, SyntheticConfig, prepare_synthetic
from titan_audit.models import build, token_logprobs
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import TrainConfig, from_dict, resume_differences, to_dict
from titan_audit.trainer.crash import crash_point
from titan_audit.trainer.fsdp import shard_model
from titan_audit.trainer.optim import build_optimizer, lr_at, set_lr
from titan_audit.trainer.reduce import TreeReducer, all_gather_single, split_point
from titan_audit.trainer.run_dir import (
    MetricsLog,
    claim_run_dir,
    has_entries,
    package_versions,
    prepare_run_dir,
    read_manifest,
    release_run_dir,
    write_manifest,
)


@dataclass
class TrainResult:
    run_dir: Path
    world_size: int
    start_step: int  # steps already done when this process started (0 for a fresh run)
    last_step: int
    losses: list[float]  # step losses of the steps run here


# ---------------------------------------------------------------------------------- process group
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_distributed(backend: str = "auto", *, single_group: bool = False) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (if any and not joined yet).
    `single_group`: without one, make a one-rank group (FSDP2 needs a group even at W=1)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size()
    if single_group:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return 0, 1


def _broadcast_error(message: str | None) -> None:
    """Rank 0's verdict reaches every rank, so all fail (or go on) together, before any work."""
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise ValueError(message)


# ---------------------------------------------------------------------------------- run directory
def check_run_dir(config: TrainConfig, out: Path, *, resume: bool, overwrite: bool, world_size: int) -> None:
    """Every check on user input that needs no compute; raises ValueError (the launcher runs it
    before torchrun starts, rank 0 again): W vs V, the data vs the model (`check_data`), and on a
    resume the saved config, the checkpoints' small files and the step it would start from."""
    config.check_world_size(world_size)
    check_data(config)
    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if resume:
        saved = read_manifest(out)
        differences = resume_differences(saved["config"], config)
        if differences:
            raise ValueError(f"{out}: the config differs from the run's saved config: {'; '.join(differences)}")
        start, _ = Checkpointer(out, keep_last=config.checkpoint.keep_last).preflight(
            fallback=config.checkpoint.fallback
        )
        if start >= config.steps:
            raise ValueError(
                f"{out}: already at step {start} of steps={config.steps}; nothing to run "
                f"(--steps N or --set steps=N with N > {start} extends it)"
            )
    elif not overwrite and out.is_dir() and has_entries(out):
        prepare_run_dir(out, resume=False, overwrite=False)  # raises with the standard message


def check_data(config: TrainConfig) -> None:
    """The data against the model, before step 1 (ValueError naming the keys): the packed
    positions lie in [0, data.seq_len) (packing.py cuts longer documents into pieces), so
    data.seq_len must not exceed the model's max_position_embeddings; every token id the store
    can hold (its tokenizer's vocab_size, EOS and PAD ids) must be below the model's vocab_size."""
    from titan_audit.data import ByteTokenizer, TokenStore

    model = config.model.model_config()
    where = f"model.preset {config.model.preset!r}" + (" with model.overrides" if config.model.overrides else "")
    if config.data.seq_len > model.max_position_embeddings:
        raise ValueError(
            f"data.seq_len = {config.data.seq_len} exceeds max_position_embeddings = "
            f"{model.max_position_embeddings} of {where}"
        )
    if config.data.store is None:
        tok = ByteTokenizer()
        name, vocab, eos, pad = "the synthetic corpus (byte tokenizer)", tok.vocab_size, tok.eos_id, tok.pad_id
    else:
        try:
            info = TokenStore(config.data.store).info
        except ValueError as error:
            raise ValueError(f"data.store: {error}") from None
        name, vocab, eos, pad = (
            f"data.store {config.data.store} (tokenizer {info.tokenizer})",
            info.vocab_size,
            info.eos_id,
            info.pad_id,
        )
    if max(vocab, eos + 1, pad + 1) > model.vocab_size:
        raise ValueError(
            f"{name} has vocab_size {vocab} (eos_id {eos}, pad_id {pad}) but vocab_size = "
            f"{model.vocab_size} of {where}: token ids would fall outside the embedding"
        )


def _prepare(config: TrainConfig, out: Path, resume: bool, overwrite: bool, world_size: int) -> tuple[Path, dict]:
    """Rank 0 validates, claims the run directory, prepares the data and writes the manifest of a
    new run. A resume's manifest update is returned (rank 0) and written by `_record_start` once
    the checkpoint has loaded, so a resume that fails leaves the run's files as they were."""
    error, claimed, manifest = None, False, {}
    if _rank() == 0:
        try:
            check_run_dir(config, out, resume=resume, overwrite=overwrite, world_size=world_size)
            out = claim_run_dir(out, resume=resume, overwrite=overwrite)  # held until train() ends
            claimed = True
            if config.data.store is None and not (out / "data" / "tasks.zarr").is_dir():
                synthetic = SyntheticConfig(num_records=config.data.synthetic_records, seed=config.data.synthetic_seed)
                prepare_synthetic(out / "data", synthetic, overwrite=True)
            manifest = read_manifest(out) if resume else {"created": _now(), "world_size_history": []}
            manifest["config"] = to_dict(config)
            manifest["seed"] = config.seed
            with _batch_invariant(config)():  # the numerics the steps run under (BI mode on or off)
                manifest["fingerprint"] = deterministic.fingerprint().to_dict()
            manifest["packages"] = package_versions()
            if not resume:
                write_manifest(out, manifest)
        except ValueError as e:
            error = str(e)
            if claimed:
                release_run_dir(out)
    else:
        config.check_world_size(world_size)
    _broadcast_error(error)
    return Path(out), manifest


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _record_start(out: Path, manifest: dict, world_size: int, start_step: int, parallel_mode: str) -> None:
    manifest.pop("format", None)
    manifest["world_size_history"].append(
        {"world_size": world_size, "start_step": start_step, "parallel_mode": parallel_mode, "time": _now()}
    )
    write_manifest(out, manifest)


# ---------------------------------------------------------------------------------- pieces of a step
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


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's .grad (zeros where None) as one fresh fp32 vector, in parameter order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


class GradBuffers:
    """One flat fp32 gradient buffer per local microbatch, allocated once and reused every step
    (fresh 16 MB allocations per microbatch cost page faults). A microbatch's gradient is
    0 + autograd's gradient, accumulated in place through .grad views: the same for every W."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.buffers: list[torch.Tensor] = []

    def zeroed(self, j: int) -> torch.Tensor:
        while len(self.buffers) <= j:
            self.buffers.append(torch.empty(self.numel, dtype=torch.float32))
        return self.buffers[j].zero_()


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n
    assert offset == flat.numel(), (offset, flat.numel())


def clip_(flat: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale `flat` in place to global norm <= max_norm (0: no clipping); returns the norm before.
    `flat` is the full reduced gradient, identical on every rank, so every rank clips alike."""
    norm = torch.linalg.vector_norm(flat, 2.0)
    if max_norm > 0:
        flat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def tree_sum(values: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Sum of values[lo:hi] (along dim 0) in the fixed tree order of reduce.py (depends on the
    count alone)."""
    hi = values.shape[0] if hi is None else hi
    if hi - lo == 1:
        return values[lo]
    mid = split_point(lo, hi)
    return tree_sum(values, lo, mid) + tree_sum(values, mid, hi)


def gather_in_index_order(local: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate every rank's block along dim 0 (rank order = microbatch index order)."""
    if world_size == 1:
        return local
    out = torch.empty((local.shape[0] * world_size, *local.shape[1:]), dtype=local.dtype)
    all_gather_single(out.view(-1), local.contiguous().view(-1))
    return out


# ---------------------------------------------------------------------------------- the loop
def train(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_at: int | None = None,
    quiet: bool = False,
    oplog_step: int | None = None,
) -> TrainResult:
    """Run (or resume) a training run into `out` on this process's rank of the current group.

    stop_at: stop after this step (<= config.steps) without changing the schedule (replay
    --verify-to); the last step always gets a checkpoint. oplog_step: record that step's
    forward, backward, reduction and optimizer update as an op log, out/oplogs/step_N.parquet
    (audit.oplog; what `titan-audit bisect --step N` compares).
    """
    rank, world_size = init_distributed(config.parallel.backend, single_group=config.parallel.mode == "fsdp")
    torch.set_num_threads(config.parallel.threads)  # before anything computes; never from W
    mode = (
        deterministic.enable(config.seed, strict=config.determinism.strict, threads=config.parallel.threads)
        if config.determinism.enabled
        else None
    )
    out, manifest = _prepare(config, Path(out), resume, overwrite, world_size)
    try:
        return _train(
            config,
            out,
            manifest,
            rank,
            world_size,
            mode,
            resume=resume,
            stop_at=stop_at,
            quiet=quiet,
            oplog_step=oplog_step,
        )
    finally:
        if rank == 0:
            release_run_dir(out)


def _train(
    config: TrainConfig,
    out: Path,
    manifest: dict,
    rank: int,
    world_size: int,
    mode,
    *,
    resume: bool,
    stop_at: int | None,
    quiet: bool,
    oplog_step: int | None,
) -> TrainResult:
    last_step = config.steps if stop_at is None else stop_at
    if not 1 <= last_step <= config.steps:
        raise ValueError(f"stop step {last_step} is outside 1..steps={config.steps}")
    if oplog_step is not None and world_size != 1:
        raise ValueError(f"an op log is recorded on one rank; this run has {world_size}")

    model = build(
        config.model.model_config(), seed=config.seed, activation_checkpointing=config.model.activation_checkpointing
    )
    compute_dtype = config.model.torch_compute_dtype
    if config.parallel.mode == "fsdp":  # FSDP2 casts the gathered parameters (its mixed precision)
        sharded = shard_model(model, deterministic=config.determinism.enabled, param_dtype=compute_dtype)
    else:  # the model casts each parameter once per forward, inside the autograd graph
        sharded = None
        model.set_compute_dtype(compute_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, config.optimizer, portable=config.determinism.batch_invariant)
    checkpointer = Checkpointer(out, keep_last=config.checkpoint.keep_last)

    start_step, loader_state = 0, None
    if resume:
        blob = checkpointer.load_latest(model, optimizer, fallback=config.checkpoint.fallback)
        if blob is not None:
            start_step = int(blob["step"])
            loader_state = LoaderState.from_dict(blob["loader"], source=str(checkpointer.path(start_step)))
    if start_step >= last_step:
        raise ValueError(f"{out}: already at step {start_step}; nothing to run up to step {last_step}")

    store = config.data.store if config.data.store is not None else str(out / "data" / "tasks.zarr")
    loader_config = LoaderConfig(
        store=store,
        seq_len=config.data.seq_len,
        global_batch_size=config.data.global_batch_size,
        microbatch_size=config.data.microbatch_size,
        seed=config.seed,
        packing=config.data.packing,
        workers=config.data.workers,
    )
    loader = ElasticLoader(loader_config, rank=rank, world_size=world_size, state=loader_state)
    V = loader.num_microbatches
    assert V == config.num_microbatches, (V, config.num_microbatches)
    reducer = TreeReducer(V)
    recorder = Recorder(
        out,
        model,
        level=config.audit.level,
        modules=config.audit.modules,
        flush_every_steps=config.audit.flush_every_steps,
    )
    metrics = MetricsLog(out) if rank == 0 else None
    if rank == 0:
        metrics.truncate_after(start_step)
        _record_start(out, manifest, world_size, start_step, config.parallel.mode)
    _barrier()

    grad_buffers = GradBuffers(sum(p.numel() for p in params))
    bi = _batch_invariant(config)
    with_aux = config.model.model_config().is_moe  # the aux loss is logged for every MoE model
    aux_scale = config.model.router_aux_loss_coef / V  # fixed by the global batch, never by W
    losses: list[float] = []
    steps = loader.steps()
    # BI mode for the whole step loop (one install of the overrides; the census also sees the
    # reduction, the clip and the optimizer); strict census: a native op stops the run.
    census.reset()
    census_off = census.off() if config.determinism.census == "off" else contextlib.nullcontext()
    with census_off, bi(), census.strict(config.determinism.census == "strict"):
        for step in range(start_step + 1, last_step + 1):
            t0 = time.perf_counter()
            recorder.start_step(step)
            lr = lr_at(step - 1, config.optimizer, config.schedule, config.steps)
            set_lr(optimizer, lr)
            microbatches = next(steps)

            # step `oplog_step` (bisect --step) runs under DebugMode: every aten op hashed, in order
            with op_log(out, f"step_{step}") if step == oplog_step else contextlib.nullcontext():
                # forward + backward, one virtual microbatch at a time, gradients into the tree
                mb_losses = []  # per local microbatch: [loss] or [loss, aux]
                optimizer.zero_grad(set_to_none=True)
                for j, mb in enumerate(microbatches):
                    if config.determinism.enabled and not sharded:
                        leaf = grad_buffers.zeroed(j)  # autograd accumulates 0 + g into views of it
                        set_grads(params, leaf)
                    recorder.set_microbatch(mb.index)
                    recorder.record_data(mb.tensors())
                    if with_aux:
                        loss, aux = microbatch_loss(model, mb, with_aux=True)
                        recorder.record_loss(loss)
                        recorder.record_loss(aux, name="aux_loss")
                        objective = loss + aux * aux_scale if aux_scale else loss
                        mb_losses.append(torch.stack([loss.detach(), aux.detach()]))
                    else:
                        loss = objective = microbatch_loss(model, mb)
                        recorder.record_loss(loss)
                        mb_losses.append(loss.detach().reshape(1))
                    objective.backward()
                    if config.determinism.enabled:
                        reducer.add(mb.index, sharded.take_flat(params) if sharded else leaf)
                        optimizer.zero_grad(set_to_none=True)
                recorder.set_microbatch(-1)

                # the step gradient: fixed-tree reduction (deterministic) or plain all_reduce (off)
                if config.determinism.enabled:
                    grad = reducer.all_reduce()
                    # in BI mode (held by the loop): the norm by the fixed-tree sum and our sqrt
                    grad_norm = clip_(grad, config.optimizer.grad_clip)
                    if sharded:
                        sharded.set_sharded(params, grad)  # this rank's shard of the full reduced gradient
                    else:
                        set_grads(params, grad)
                elif sharded:  # conventional FSDP2: its reduce-scatters averaged into the shards; want the sum
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(world_size)
                    grad_norm = _full(
                        torch.nn.utils.clip_grad_norm_(params, config.optimizer.grad_clip or float("inf"))
                    )
                else:
                    grad = flat_grad(params)
                    if world_size > 1:
                        dist.all_reduce(grad)
                    grad_norm = clip_(grad, config.optimizer.grad_clip)
                    set_grads(params, grad)
                recorder.record_grads()
                optimizer.step()
                recorder.record_optimizer(optimizer)
                recorder.record_params()

            # [V, 1 or 2]: loss (and aux) of every microbatch in index order, summed by the fixed tree
            step_sums = tree_sum(gather_in_index_order(torch.stack(mb_losses), world_size))
            step_loss = float(step_sums[0])
            extra = {"aux_loss": float(step_sums[1]) / V} if with_aux else {}  # mean per microbatch
            losses.append(step_loss)
            seconds = time.perf_counter() - t0
            tokens = config.data.global_batch_size * config.data.seq_len
            if rank == 0:
                metrics.append(
                    {
                        "step": step,
                        "loss": step_loss,
                        **extra,
                        "grad_norm": float(grad_norm),
                        "lr": lr,
                        "tokens": tokens,
                        "seconds": seconds,
                        "world_size": world_size,
                    }
                )
                metrics.flush()
                if not quiet:
                    print(
                        f"step {step}/{last_step}  loss {step_loss:.4f}  grad_norm {float(grad_norm):.3f}  "
                        f"lr {lr:.2e}  {tokens / seconds:,.0f} tok/s  W={world_size}",
                        file=sys.stderr,
                        flush=True,
                    )
            recorder.end_step()
            crash_point("train.after_step", step)

            interval = config.checkpoint.interval
            if step == last_step or (interval and step % interval == 0):
                recorder.flush()
                blob = {
                    "step": step,
                    "loader": loader.state().to_dict(),
                    "config": to_dict(config),
                    "world_size": world_size,
                }
                checkpointer.save(step, model, optimizer, blob)
    if config.determinism.batch_invariant and rank == 0:
        record_census(out, config.determinism.census)
    recorder.close()
    loader.close()
    if mode is not None:
        mode.__exit__(None, None, None)
    return TrainResult(out, world_size, start_step, last_step, losses)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _batch_invariant(config: TrainConfig):
    if config.determinism.batch_invariant:
        from titan_audit.batch_invariant import enabled

        return enabled
    return contextlib.nullcontext


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank under torchrun: `python -m titan_audit.trainer.train CONFIG_JSON OUT
    [resume] [overwrite] [quiet] [stop_at=N]` (the CLI writes the resolved config to a JSON file)."""
    from titan_audit.trainer.launch import rank_main

    def run(config: dict, out: str, flags: set[str]) -> None:
        stop_at = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("stop_at=")), None)
        train(
            from_dict(config),
            out,
            resume="resume" in flags,
            overwrite="overwrite" in flags,
            stop_at=stop_at,
            quiet="quiet" in flags,
        )

    rank_main(sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    main()
