"""The run engine under `train` and `rl`: one set-up, one step kit, one close.

    with Run(config, out, kind="train", check=check) as run:
        model, optimizer = ...                      # the loop's own components
        blob = run.restore(model, optimizer)        # on a resume: the latest verified checkpoint
        run.begin(model, optimizer)                 # recorder, metrics log, manifest history
        kit = StepKit(run, params, optimizer)
        for step in run.steps():                    # start_step + 1 .. last_step
            lr = kit.start(step)
            for j, mb in enumerate(microbatches):   # this rank's microbatches, in index order
                with kit.microbatch(mb.index):
                    loss.backward()                 # what the loss is: the loop's own business
            grad_norm = kit.finish()                # fixed tree, clip, AdamW, audit records
            run.end_step(step, row, line)           # metrics row, log line, checkpoint at interval

A loop says only what is its own: where its microbatches come from and what their loss is.

Guarantees:
- Set-up, in this order, identical for both loops: join the process group (the mesh: W = dp x tp
  ranks, a (dp, tp) DeviceMesh when `parallel.tp` > 1, of the device type `parallel.device`; on
  cuda each rank first takes GPU LOCAL_RANK; backend "auto" is nccl on cuda, gloo on cpu), the intra-op
  thread count from the config (never from W), the run's numerics (deterministic switches and
  seeds; with `determinism.batch_invariant`, BI mode, its op census and the gemm order
  `determinism.bi_kernels` for the whole run, every thread), then on rank 0 every input check
  (`check`: the loop's check_run, which its launcher runs too, and which ends with `check_run_dir`), the run lock
  (`claim_run_dir`, held until the run closes), the manifest with the numerics fingerprint taken
  under the run's own numerics. Rank 0's verdict reaches every rank before any work, so all fail or
  go on together; a new run's manifest is written at once, a resume's only after its checkpoint
  loaded (`begin`), so a resume that fails leaves the run's files as they were. The fingerprint
  and the mesh in the manifest are those of the configured device, never of what is visible.
- The device (`parallel.device`, `run.mesh.device`): a loop builds and initialises its model on
  the CPU exactly as a CPU run does (the initial weights' bits are our CPU code's), then moves it
  there; what it computes with (batches, log-probs, gradient buffers, the optimizer state, which
  torch allocates beside the parameters) lives there too. What leaves the device is copied, never
  converted: audit hashes and checkpoints read the bytes (`.cpu()`), and the collectives of
  reduce.py move bytes only. On cpu every one of these moves is the identity: a CPU run computes
  what it computed before the key existed.
- Close on any exception (`__exit__`): the recorder and what the loop registered with `closing`
  are closed, BI mode and the deterministic switches are restored, the lock is
  released. The op census is written to the manifest when the run ends without an error.
- The step kit: fp32 gradient buffers from a pool (data parallel: at most floor(log2(V/W)) + 1 in
  use at once when V/W is a power of two, none allocated after the first step), the fixed-tree
  reduction over the V microbatch gradients (reduce.py; the same bits on every rank and for every
  W; over the dp ranks: a TP rank's buffer holds its local shards, reduced elementwise like the
  full vector's slices; under FSDP2 the sharded tree of fsdp.py), grad-norm clipping by a norm
  with the same bits at every layout (grad_norm.py: from the rows each rank holds), the optimizer
  step, the audit records of a step. With
  `determinism.enabled = false` (train only) it is a conventional trainer: gradients accumulated in
  .grad and one plain all_reduce (or FSDP2's own reduce-scatter), the negative control.
- Checkpoints: `end_step` saves a verified checkpoint every `checkpoint.interval` steps and at the
  last step; its rank-agnostic blob holds step, config, world size and what the loop adds.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_audit import deterministic
from titan_audit.audit import Recorder
from titan_audit.audit.log import check_audit_log
from titan_audit.audit.run_manifest import record_census
from titan_audit.log import get_logger
from titan_audit.trainer import grad_norm as norms
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.crash import crash_point
from titan_audit.trainer.metrics_out import MetricsStreams, check_logging
from titan_audit.trainer.optim import lr_at, set_lr
from titan_audit.trainer.reduce import TreeReducer, gather_in_index_order
from titan_audit.trainer.run_dir import (
    MetricsLog,
    check_out_path,
    claim_run_dir,
    package_versions,
    read_manifest,
    release_run_dir,
    write_manifest,
)

log = get_logger(__name__)


# ---------------------------------------------------------------------------------- the mesh
@dataclass(frozen=True)
class Mesh:
    """Where this process sits: data parallel (dp ranks) x tensor parallel (tp ranks), W = dp * tp,
    global rank = dp_rank * tp + tp_rank (torch's row-major DeviceMesh). TP ranks of one dp rank
    read the same microbatches; the loader and the gradient tree run over the dp group.
    Recorded in the manifest's history, like the world size: never part of the numerics."""

    device_type: str  # "cpu" | "cuda": parallel.device
    world_size: int
    rank: int
    tp: int = 1
    device_mesh: Any = None  # the (dp, tp) DeviceMesh when tp > 1
    device_index: int | None = None  # on cuda: this rank's GPU (LOCAL_RANK)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: the CPU, or its own GPU (explicit index, valid in any thread)."""
        return torch.device(self.device_type, self.device_index)

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's dp peers (None: the default group, at tp = 1)."""
        return None if self.device_mesh is None else self.device_mesh.get_group("dp")

    @property
    def tp_mesh(self) -> Any:
        return None if self.device_mesh is None else self.device_mesh["tp"]

    @property
    def dp_mesh(self) -> Any:
        """The dp dimension of the (dp, tp) mesh (None at tp = 1)."""
        return None if self.device_mesh is None else self.device_mesh["dp"]

    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards over: the dp dimension of the (dp, tp) mesh, or at tp = 1 a 1-D
        mesh of every rank on this run's device (FSDP2's own default mesh would be CUDA whenever a
        GPU is visible, whatever the config says). Needs the process group."""
        if self.device_mesh is not None:
            return self.device_mesh["dp"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))

    def describe(self) -> str:
        """The progress lines' layout: W=4, or with tensor parallelism W=4 (dp 2 x tp 2)."""
        return f"W={self.world_size}" + (f" (dp {self.dp} x tp {self.tp})" if self.tp > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "dp": self.dp, "tp": self.tp}


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def resolve_backend(backend: str, device: str) -> str:
    """The process-group backend of `parallel.backend` on `parallel.device`: "auto" is nccl on
    cuda and gloo on cpu (by the configured device alone, never by what this machine has)."""
    assert device in ("cpu", "cuda"), device
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


def init_mesh(backend: str = "auto", *, device: str = "cpu", single_group: bool = False, tp: int = 1) -> Mesh:
    """Join the process group torchrun describes in the environment (if any and not joined yet),
    on `device` ("cpu" | "cuda": on cuda this rank first takes GPU LOCAL_RANK, a ValueError naming
    parallel.device when the node has fewer GPUs). `single_group`: without one, make a one-rank
    group (FSDP2 needs a group even at W=1). tp > 1: the (dp, tp) DeviceMesh of `device` over the
    group (the caller checked that tp divides W)."""
    backend = resolve_backend(backend, device)
    index = None
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= visible:
            raise ValueError(
                f"parallel.device = 'cuda': local rank {index} needs GPU {index} and this node has {visible} "
                f"visible; run at most {visible} rank(s) per node"
            )
        torch.cuda.set_device(index)
    if not dist.is_initialized():  # no device_id: NCCL starts lazily, after deterministic.enable pinned its order
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            dist.init_process_group(backend)
        elif single_group or tp > 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized():
        return Mesh(device, 1, 0, device_index=index)
    world_size = dist.get_world_size()
    device_mesh = None
    if tp > 1 and world_size % tp == 0:
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return Mesh(device, world_size, dist.get_rank(), tp if device_mesh is not None else 1, device_mesh, index)


def broadcast_error(message: str | None) -> None:
    """Rank 0's verdict reaches every rank, so all fail (or go on) together, before any work."""
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise ValueError(message)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------- input checks
def check_backend(config: Any) -> None:
    """`parallel.device` and `parallel.backend` against this build of torch, this machine and each
    other (ValueError naming the key): cuda needs a visible CUDA device; NCCL needs a torch built
    with it and moves CUDA tensors only, so it goes with cuda; gloo, in every build, goes with cpu
    (the trainer's collectives move the device's tensors as they are); "auto" picks the one that
    goes with the device."""
    device, backend = config.parallel.device, config.parallel.backend
    if device == "cuda" and not torch.cuda.is_available():
        build = (
            f"a CPU build of torch {torch.__version__}" if torch.version.cuda is None else f"torch {torch.__version__}"
        )
        raise ValueError(
            f"parallel.device = 'cuda' needs a CUDA device and none is visible here ({build}); "
            f"use parallel.device = 'cpu' (or --device cpu)"
        )
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError(
            f"parallel.backend = 'nccl': this torch build ({torch.__version__}) has no NCCL; "
            f"use parallel.backend = 'gloo' (or 'auto': nccl on parallel.device = 'cuda', else gloo)"
        )
    if backend == "nccl" and device != "cuda":
        raise ValueError(
            f"parallel.backend = 'nccl' moves CUDA tensors and parallel.device = {device!r}; "
            f"use parallel.backend = 'gloo' or 'auto', or parallel.device = 'cuda'"
        )
    if backend == "gloo" and device != "cpu":
        raise ValueError(
            f"parallel.backend = 'gloo' moves CPU tensors here and parallel.device = {device!r}; "
            f"use parallel.backend = 'nccl' or 'auto' (nccl on cuda)"
        )


def check_run_dir(
    config: Any, out: Path, *, kind: str, mutable: frozenset[str], resume: bool, overwrite: bool | str
) -> None:
    """The run directory against the request (ValueError; no compute, nothing written): --resume
    and --overwrite exclude each other; a resume needs a run of the same kind whose saved config
    differs only in `mutable` keys, checkpoints whose small files verify, an audit log whose parts
    all read, and a step to run; a new
    run needs an empty (or missing) directory unless --overwrite, outside any other run's
    directory and without runs below it (run_dir.check_out_path). The metrics streams the run
    writes there must be available (metrics_out.check_logging: TensorBoard installed)."""
    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    check_logging(config)
    if resume:
        saved = _saved_manifest(out, kind)
        differences = typed_config.resume_differences(saved["config"], config, mutable)
        if differences:
            raise ValueError(f"{out}: the config differs from the run's saved config: {'; '.join(differences)}")
        checkpointer = Checkpointer(out, keep_last=config.checkpoint.keep_last)
        start, _ = checkpointer.preflight(fallback=config.checkpoint.fallback)
        if start >= config.steps:
            raise ValueError(
                f"{out}: already at step {start} of steps={config.steps}; nothing to run "
                f"(--steps N or --set steps=N with N > {start} extends it)"
            )
        # the parts it appends to, and after its checkpoint; nothing written (marks come from the
        # writers, once the checkpoint has loaded: a resume that fails leaves the run as it was)
        check_audit_log(out, after_step=start, mark=False)
    else:
        check_out_path(out, overwrite=overwrite)


def _saved_manifest(out: Path, kind: str) -> dict[str, Any]:
    """The manifest of the run in `out`, which must be a `kind` run (ValueError naming both)."""
    saved = read_manifest(out)
    saved_kind = saved.get("kind", "train")
    if saved_kind != kind:
        what = {"train": "a train run", "rl": "an RL run"}
        raise ValueError(
            f"{out}: {what.get(saved_kind, saved_kind)}, not {what[kind]} (use `titan-audit {saved_kind} --resume`)"
        )
    return saved


def resolve_config(cls: type, load: Callable, source: str | None, out: Path, *, kind: str, resume: bool, overrides):
    """The config of a launch: `load(source, overrides)` (a recipe name or a TOML file); with no
    source on a resume, the config saved in the `kind` run's manifest with the overrides applied."""
    if source is not None:
        return load(source, list(overrides))
    if not resume:
        recipe = "an RL recipe" if kind == "rl" else "a recipe"
        raise ValueError(f"--config is required ({recipe} name or a TOML file) unless --resume")
    saved = typed_config.fill_added_keys(cls, _saved_manifest(Path(out), kind)["config"])
    return typed_config.build(cls, typed_config.apply_overrides(saved, list(overrides)), f"{out}/manifest.json config")


# ---------------------------------------------------------------------------------- the run
class Run:
    """One run of a loop on this rank, from set-up to close (see the module docstring).

    config: a TrainConfig or RLConfig (the sections both have: seed, steps, parallel, determinism,
    optimizer, schedule, checkpoint, audit). kind: "train" | "rl" (the manifest's kind, the crash
    points' prefix). check(world_size): every input check of the loop, ValueError (rank 0, before
    the lock; the loop's `check_run`, which its launcher runs too, and which calls
    `check_run_dir`). prepare(out): rank 0, after the lock, before the manifest (the train loop's
    synthetic corpus). extra(): keys of a new run's manifest. stop_at: the last step to run
    (default config.steps)."""

    def __init__(
        self,
        config: Any,
        out: str | os.PathLike,
        *,
        kind: str,
        check: Callable[[int], None],
        resume: bool = False,
        overwrite: bool | str = False,
        prepare: Callable[[Path], None] | None = None,
        extra: Callable[[], dict[str, Any]] | None = None,
        stop_at: int | None = None,
        quiet: bool = False,
        single_group: bool = False,
    ) -> None:
        self.config, self.out, self.kind = config, Path(out), kind
        self.resume, self.overwrite, self.quiet = resume, overwrite, quiet
        self._check, self._prepare_out, self._extra, self._single_group = check, prepare, extra, single_group
        self.last_step = config.steps if stop_at is None else stop_at
        self.start_step = 0
        self.manifest: dict[str, Any] = {}
        self.recorder: Recorder | None = None
        self.metrics: MetricsLog | None = None
        self.streams: MetricsStreams | None = None
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._stack = contextlib.ExitStack()

    # -- set-up and close
    def __enter__(self) -> Run:
        try:
            self._set_up()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.config.determinism.batch_invariant and self.mesh.rank == 0:
                record_census(self.out, self.config.determinism.census)
        finally:
            self._stack.close()

    def _set_up(self) -> None:
        config = self.config
        if not 1 <= self.last_step <= config.steps:
            raise ValueError(f"stop step {self.last_step} is outside 1..steps={config.steps}")
        parallel = config.parallel
        if parallel.device == "cuda" and config.determinism.enabled:
            # init_mesh initialises CUDA (this rank's GPU); cuBLAS's deterministic workspace must be
            # set before that. NCCL's pinned order (deterministic.enable) precedes its lazy init.
            from titan_audit.deterministic.switches import CUBLAS_WORKSPACE

            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        self.mesh = init_mesh(parallel.backend, device=parallel.device, single_group=self._single_group, tp=parallel.tp)
        torch.set_num_threads(config.parallel.threads)  # before anything computes; never from W
        self._enter_numerics()
        self._claim()
        self.checkpointer = Checkpointer(self.out, keep_last=config.checkpoint.keep_last)

    def _enter_numerics(self) -> None:
        """Deterministic switches and seeds; BI mode (process-wide: every thread) and its census."""
        config, stack = self.config, self._stack
        if config.determinism.enabled:
            stack.enter_context(
                deterministic.enable(config.seed, strict=config.determinism.strict, threads=config.parallel.threads)
            )
        if config.determinism.batch_invariant:
            from titan_audit import batch_invariant

            if config.determinism.census == "off":
                stack.enter_context(batch_invariant.census.off())
            stack.enter_context(batch_invariant.enabled(gemm_order=config.determinism.bi_kernels))
            batch_invariant.census.reset()
            stack.enter_context(batch_invariant.census.strict(config.determinism.census == "strict"))

    def _claim(self) -> None:
        """Rank 0: checks, lock, the run's data, the manifest; the verdict and manifest to all."""
        error = None
        if self.mesh.rank == 0:
            try:
                self._check(self.mesh.world_size)  # the loop's check_run: the same as its launcher's
                self.out = claim_run_dir(self.out, resume=self.resume, overwrite=self.overwrite)
                self._stack.callback(release_run_dir, self.out)
                if self._prepare_out is not None:
                    self._prepare_out(self.out)
                self.manifest = self._manifest()
                if not self.resume:
                    write_manifest(self.out, self.manifest)
            except ValueError as e:
                error = str(e)
        else:
            self.config.check_world_size(self.mesh.world_size)
        broadcast_error(error)
        if dist.is_initialized():
            box = [(str(self.out), self.manifest)]
            dist.broadcast_object_list(box, src=0)
            self.out, self.manifest = Path(box[0][0]), box[0][1]

    def _manifest(self) -> dict[str, Any]:
        manifest = read_manifest(self.out) if self.resume else {"created": now(), "world_size_history": []}
        manifest.pop("format", None)
        manifest["kind"] = self.kind
        manifest["config"] = typed_config.to_dict(self.config)
        manifest["seed"] = self.config.seed
        # under the run's numerics, of the configured device (not whatever device is visible)
        manifest["fingerprint"] = deterministic.fingerprint(self.mesh.device).to_dict()
        manifest["packages"] = package_versions()
        if not self.resume and self._extra is not None:
            manifest.update(self._extra())
        return manifest

    def closing(self, thing: Any) -> Any:
        """Close `thing` (its .close()) when the run closes, whatever happens; returns it."""
        self._stack.callback(thing.close)
        return thing

    # -- resume and start
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """On a resume: load the latest verified checkpoint into model and optimizer (falling back
        to an older one if the config allows) and return its blob; start_step is its step."""
        blob = None
        if self.resume:
            blob = self.checkpointer.load_latest(model, optimizer, fallback=self.config.checkpoint.fallback)
            if blob is not None:
                self.start_step = int(blob["step"])
        if self.start_step >= self.last_step:
            raise ValueError(
                f"{self.out}: already at step {self.start_step}; nothing to run up to step {self.last_step}"
            )
        return blob

    def begin(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Open the recorder (every rank) and the metrics log with its streams (rank 0, cut back
        to start_step: metrics_out.py), append this start to the manifest's history (rank 0), and
        wait for every rank."""
        self._model, self._optimizer = model, optimizer
        audit = self.config.audit
        self.recorder = self.closing(
            Recorder(
                self.out,
                model,
                level=audit.level,
                modules=audit.modules,
                flush_every_steps=audit.flush_every_steps,
                writes_microbatches=self.mesh.tp_rank == 0,  # TP peers hold the same microbatches
            )
        )
        if self.mesh.rank == 0:
            self.metrics = MetricsLog(self.out)
            self.metrics.truncate_after(self.start_step)
            self.streams = self.closing(MetricsStreams(self.out, self.config.logging, self.metrics.rows))
            self.manifest["world_size_history"].append(
                {
                    "world_size": self.mesh.world_size,
                    "start_step": self.start_step,
                    "parallel_mode": getattr(self.config.parallel, "mode", "dp"),
                    "mesh": self.mesh.to_dict(),
                    "time": now(),
                }
            )
            write_manifest(self.out, self.manifest)
        if self.start_step and not self.quiet:
            log.info("resumed %s from step %d at W=%d", self.out, self.start_step, self.mesh.world_size)
        log.debug(
            "%s run %s: steps %d..%d, mesh %s", self.kind, self.out, self.start_step + 1, self.last_step, self.mesh
        )
        barrier()

    def steps(self) -> range:
        return range(self.start_step + 1, self.last_step + 1)

    # -- the end of a step
    def end_step(
        self,
        step: int,
        row: dict[str, Any],
        line: str,
        blob: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """The metrics row (rank 0: metrics.parquet and its streams, flushed), the progress line
        (rank 0 unless quiet), the audit step closed, the crash point `<kind>.after_step`, and at
        `checkpoint.interval` (and the last step) an audit flush and a verified checkpoint whose
        blob adds `blob()` (called on every rank at checkpoint steps only: it may be collective)."""
        assert self.recorder is not None, "begin() before the first step"
        if self.metrics is not None:
            self.metrics.append(row)
            self.metrics.flush()
            self.streams.write(row)
        if not self.quiet:
            log.log(logging.INFO if self.mesh.rank == 0 else logging.DEBUG, "%s", line)  # other ranks: -v
        self.recorder.end_step()
        crash_point(f"{self.kind}.after_step", step)
        interval = self.config.checkpoint.interval
        if step == self.last_step or (interval and step % interval == 0):
            self.recorder.flush()
            state = {"step": step, "config": typed_config.to_dict(self.config), "world_size": self.mesh.world_size}
            state.update(blob() if blob is not None else {})
            self.checkpointer.save(step, self._model, self._optimizer, state)


# ---------------------------------------------------------------------------------- the step kit
def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's .grad becomes its slice of `flat` (a view, cast to the parameter's dtype);
    a tensor-parallel (DTensor) parameter's local shard is its slice, wrapped in its placement."""
    offset = 0
    for p in params:
        local = local_shape(p)
        n = local.numel()
        grad = flat[offset : offset + n].view(local).to(p.dtype)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False) if is_dtensor(p) else grad
        offset += n
    assert offset == flat.numel(), (offset, flat.numel())


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's .grad (zeros where None; a DTensor's local shard) as one fresh fp32
    vector, in parameter order."""
    parts = []
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros(local_shape(p), dtype=p.dtype, device=p.device)
        parts.append((grad.to_local() if is_dtensor(grad) else grad).reshape(-1).float())
    return torch.cat(parts)


def clip_(flat: torch.Tensor, max_norm: float, full: torch.Tensor | None = None) -> torch.Tensor:
    """Scale `flat` in place to global norm <= max_norm (0: no clipping); returns the norm before.
    The norm is that of the full reduced gradient (`flat` itself, or under tensor parallelism
    `full`: every shard gathered, in the TP=1 order), identical on every rank, so every rank clips
    alike."""
    norm = torch.linalg.vector_norm(flat if full is None else full, 2.0)
    if max_norm > 0:
        flat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class GradBuffers:
    """A pool of flat fp32 gradient buffers of `numel` elements on the parameters' device.

    `take` lends a zeroed buffer, a free one if there is one, else a new one; `give` takes it back
    (it must be one this pool lent and has not had back). Buffers are never freed, so once a step
    has run, the same steps allocate nothing (fresh 16 MB allocations per microbatch cost page
    faults). A microbatch's gradient is 0 + autograd's gradient, accumulated in place through .grad
    views: the same bits for every W and whichever buffer it lands in. `allocated` counts the
    buffers made, `peak` the most lent at once."""

    def __init__(self, numel: int, device: torch.device | str = "cpu") -> None:
        self.numel, self.device = numel, torch.device(device)
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # id -> buffer, while lent
        self.allocated = 0
        self.peak = 0

    @property
    def lent(self) -> int:
        """How many buffers are out now."""
        return len(self._lent)

    def take(self) -> torch.Tensor:
        if self._free:
            buffer = self._free.pop()  # the last one given back: the likeliest still in cache
        else:
            buffer = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self.allocated += 1
        assert id(buffer) not in self._lent
        self._lent[id(buffer)] = buffer
        self.peak = max(self.peak, len(self._lent))
        return buffer.zero_()

    def give(self, buffer: torch.Tensor) -> None:
        assert self._lent.pop(id(buffer), None) is buffer, "given back a buffer this pool has not lent"
        self._free.append(buffer)


class StepKit:
    """The part of a step both loops share, from the learning rate to the audited update.

    Deterministic (always for rl), data parallel: each microbatch's gradient lands in a zeroed
    buffer from the pool (`buffers`), which goes into the TreeReducer under the microbatch's GLOBAL
    index; the reducer gives each buffer back once it is spent (added into its left sibling, or
    sent). `finish` reduces by the fixed tree, clips, gives each parameter its slice (views of the
    reduced buffer, valid until the next step's first microbatch) and steps the optimizer; then the
    reduced buffer goes back too, so every buffer is in the pool between steps. Memory per rank:
    the pool lends at most floor(log2(V/W)) + 1 gradient-sized buffers at once when V/W is a power
    of two (for any W, 3 included; otherwise at most 2*floor(log2(V/W)) + 1, e.g. 3 at V = 6,
    W = 2), all allocated in the first step. With the exchange's receive scratch on gloo (under one
    gradient), that is at most floor(log2(V/W)) + 2 gradient-sized buffers per rank; gradients up
    to COLLECTIVE_MAX_BYTES also keep a send buffer, and on one host the shared file replaces both
    (reduce.py).
    Deterministic FSDP2 (`sharded`, a trainer/fsdp.py ShardedTree): rank r runs the microbatches
    k*W + r (`interleaved`); FSDP's reduce-scatter step feeds each group's pieces to the group's
    tree of shard partials during the backward, and `finish` gives each parameter its reduced
    shard: memory per rank ~ (floor(log2(V/W)) + 1) x P/W for gradients, never a full one.
    The clip norm (trainer/grad_norm.py, `determinism.grad_norm`): order v2 from the rows each rank
    holds, only row values exchanged; order v1 over the full flat gradient (gathered where sharded).
    Conventional (`determinism.enabled = false`): .grad accumulates, one plain all_reduce (FSDP2:
    its own reduce-scatter, rescaled to the sum)."""

    def __init__(self, run: Run, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, sharded=None):
        self.run, self.params, self.optimizer, self.sharded = run, params, optimizer, sharded
        self.config = run.config
        self.deterministic = bool(run.config.determinism.enabled)
        self.norm_order = getattr(run.config.determinism, "grad_norm", "v2")
        self.interleaved = self.deterministic and sharded is not None
        group = run.mesh.dp_group  # TP ranks of a dp rank hold the same microbatches: the tree is over dp
        pooled = self.deterministic and not sharded
        self.buffers = GradBuffers(sum(local_shape(p).numel() for p in params) if pooled else 0, run.mesh.device)
        self.reducer = TreeReducer(run.config.num_microbatches, group, self.buffers.give) if pooled else None
        self.tensor_parallel = run.mesh.tp > 1
        self._leaf: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None  # the pool's buffer holding this step's reduced gradient

    def start(self, step: int) -> float:
        """Open the step's audit records and set its learning rate (returned)."""
        assert self.run.recorder is not None, "run.begin() before the first step"
        self.run.recorder.start_step(step)
        lr = lr_at(step - 1, self.config.optimizer, self.config.schedule, self.config.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        if self.interleaved:
            self.sharded.start_step(self.config.num_microbatches)
        return lr

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """This rank's next microbatch, global index `index`: its records and its gradient (the
        block's backward) go under `index`; deterministic: the gradient goes into the tree there."""
        if self.reducer is not None:
            self._leaf = self.buffers.take()  # autograd accumulates 0 + g into views of it
            set_grads(self.params, self._leaf)
        self.run.recorder.set_microbatch(index)
        yield
        if self.reducer is not None:
            self.reducer.add(index, self._leaf)
        if self.interleaved:
            self.sharded.end_backward()
        if self.deterministic:  # FSDP2: what FSDP wrote into .grad is not the tree's; drop it
            self.optimizer.zero_grad(set_to_none=True)

    def gather_in_index_order(self, local: torch.Tensor) -> torch.Tensor:
        """Every dp rank's rows of `local` (one per local microbatch) in microbatch index order."""
        dp = self.run.mesh.dp
        out = gather_in_index_order(local, dp, self.run.mesh.dp_group)
        if self.interleaved and dp > 1:  # rank r's j-th row is microbatch j*W + r
            out = out.view(dp, -1, *out.shape[1:]).transpose(0, 1).reshape(out.shape)
        return out

    def finish(self) -> float:
        """The step's gradient, clipping, optimizer step and their audit records; the grad norm."""
        recorder = self.run.recorder
        recorder.set_microbatch(-1)
        grad_norm = self._reduce_and_clip()
        recorder.record_grads()
        self.optimizer.step()
        recorder.record_optimizer(self.optimizer)
        recorder.record_params()
        if self._reduced is not None:  # the optimizer and the records are done with it
            self.buffers.give(self._reduced)
            self._reduced = None
        assert self.buffers.lent == 0, f"{self.buffers.lent} gradient buffers still lent after the step"
        return float(grad_norm)

    def _reduce_and_clip(self) -> torch.Tensor:
        max_norm = self.config.optimizer.grad_clip
        if self.interleaved:  # FSDP2: each rank's reduced shards, clipped by the norm from its rows
            self.sharded.finish()
            grads = [p.grad.to_local() for p in self.params]
            return _clip_pieces(grads, max_norm, self._norm(grads))
        if self.deterministic:  # the fixed tree; in BI mode the norm by the tree sum and our sqrt
            grad = self._reduced = self.reducer.all_reduce()
            grad_norm = _clip_pieces([grad], max_norm, self._norm(_local_views(self.params, grad), flat=grad))
            set_grads(self.params, grad)
            return grad_norm
        world_size = self.run.mesh.world_size
        if getattr(self.config.parallel, "mode", "dp") == "fsdp":
            # conventional FSDP2: its reduce-scatters averaged into the shards; want the sum
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(world_size)
            return _full(torch.nn.utils.clip_grad_norm_(self.params, max_norm or float("inf")))
        grad = flat_grad(self.params)
        if self.run.mesh.dp > 1:
            dist.all_reduce(grad, group=self.run.mesh.dp_group)
        grad_norm = clip_(grad, max_norm, full_flat(self.params, grad) if self.tensor_parallel else None)
        set_grads(self.params, grad)
        return grad_norm

    def _norm(self, grads: list[torch.Tensor], flat: torch.Tensor | None = None) -> torch.Tensor:
        """The global gradient norm (grad_norm.py) of these local gradients, one per parameter."""
        mesh = self.run.mesh
        if self.norm_order == "v1":
            if self.interleaved:  # every shard gathered: the old order needs the whole vector
                return norms.full_norm_v1(torch.cat([_full(p.grad).reshape(-1) for p in self.params]))
            return norms.full_norm_v1(full_flat(self.params, flat) if self.tensor_parallel else flat)
        pieces = [
            norms.Piece(
                g,
                rows=_unsharded_rows(p) if self.interleaved else None,
                tp_dim=norms.tp_dim(p),
                full_rows=p.shape[0] if p.dim() else 1,
            )
            for p, g in zip(self.params, grads, strict=True)
        ]
        tp_group = mesh.tp_mesh.get_group() if self.tensor_parallel else None
        dp = mesh.dp if self.interleaved else 1
        return norms.norm_v2(pieces, dp_group=mesh.dp_group, dp=dp, tp_group=tp_group, tp=mesh.tp)


def _clip_pieces(pieces: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Scale every piece in place so the global norm is <= max_norm (0: no clipping); elementwise,
    so each element gets the bits it gets in any other layout. Returns the norm before."""
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for piece in pieces:
            piece.mul_(scale)
    return norm


def _unsharded_rows(p: torch.Tensor) -> int:
    """The dim 0 FSDP2 shards over dp: the TP-local tensor's (a Shard(0) over tp cuts it first)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    if norms.tp_dim(p) == 0:
        mesh = p.device_mesh
        tp, rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
        rows = norms.chunk_sizes(rows, tp)[rank]
    return rows


def _local_views(params: list[torch.nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's local gradient as a view of `flat` (set_grads' layout)."""
    out, offset = [], 0
    for p in params:
        local = local_shape(p)
        out.append(flat[offset : offset + local.numel()].view(local))
        offset += local.numel()
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local_shape(p: torch.Tensor) -> torch.Size:
    """The shape this rank holds of `p` (a DTensor's local shard; else p's own)."""
    return p.to_local().shape if is_dtensor(p) else p.shape


def full_flat(params: list[torch.nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
    """The full gradient vector in the TP=1 order from this rank's `flat` of local shards: every
    tensor-parallel parameter's slice gathered to its full tensor (collective over its mesh)."""
    parts, offset = [], 0
    for p in params:
        local = local_shape(p)
        piece = flat[offset : offset + local.numel()]
        offset += local.numel()
        if is_dtensor(p):
            piece = DTensor.from_local(piece.view(local), p.device_mesh, p.placements, run_check=False)
            piece = piece.full_tensor().reshape(-1)
        parts.append(piece)
    return torch.cat(parts)
