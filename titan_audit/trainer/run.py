"""One run of a loop on this rank, from set-up to close (`Run`), as both loops use it.

    with Run(config, out, job=JOB, options=options) as run:
        model, optimizer = ...                      # the loop's own components
        blob = run.restore(model, optimizer)        # on a resume: the latest verified checkpoint
        run.begin(model, optimizer)                 # recorder, metrics log, manifest history
        kit = StepKit(run, params, optimizer)       # trainer/step.py
        for step in run.steps():
            ...                                     # the loop's microbatches and loss
            run.end_step(step, row, line)           # metrics row, log line, checkpoint at interval

Guarantees:
- Set-up, in this order, the same for both loops: the mesh (trainer/mesh.py), the intra-op thread
  count from the config (never from W), the run's numerics (deterministic switches and seeds; BI
  mode with its census and gemm order for the whole run), then on rank 0 the job's checks
  (`job.check_run`, the same its launcher ran), the run lock (held until the run closes), the
  job's data (`job.prepare`) and the manifest with the fingerprint taken under the run's own
  numerics, of the configured device. Rank 0's verdict reaches every rank before any work; a new
  run's manifest is written at once, a resume's only after its checkpoint loaded (`begin`).
- Close on any exception: the recorder and what the loop registered with `closing` are closed,
  BI mode and the deterministic switches restored, the lock released; the op census is written
  to the manifest when the run ends without an error.
- `end_step` saves a verified checkpoint every `checkpoint.interval` steps and at the last step.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_audit import deterministic
from titan_audit.audit import Recorder, run_lock
from titan_audit.audit.log import mark_known
from titan_audit.audit.run_manifest import digest_settings, record_census
from titan_audit.log import get_logger
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.crash import crash_point
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions
from titan_audit.trainer.mesh import barrier, broadcast_error, init_mesh
from titan_audit.trainer.metrics_out import MetricsStreams
from titan_audit.trainer.run_dir import (
    MetricsLog,
    claim_run_dir,
    package_versions,
    read_manifest,
    write_manifest,
)

log = get_logger(__name__)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Run:
    """One run of a job's loop on this rank, from set-up to close (see the module docstring).

    config: a TrainConfig or RLConfig (the sections both have: seed, steps, parallel, determinism,
    optimizer, schedule, checkpoint, audit). job: the job's spec (trainer/launch/spec.py: its kind,
    checks, files and manifest keys). options: the launch's (resume, overwrite, stop_at: the last
    step to run, default config.steps; quiet). single_group: a process group even at W = 1
    (FSDP2 needs one). `checked`: what the job's `check_run` returned (rank 0; None elsewhere)."""

    def __init__(
        self, config: Any, out: str | os.PathLike, *, job: JobSpec, options: LaunchOptions, single_group: bool = False
    ) -> None:
        self.config, self.out, self.job, self.options = config, Path(out), job, options
        self.kind = job.kind
        self.resume, self.overwrite, self.quiet = options.resume, options.overwrite, options.quiet
        self._single_group = single_group
        self.checked: Any = None
        stop_at = options.stop_at
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
                # the job's check_run: the same as its launcher's (less what the launcher verified)
                self.checked = self.job.check_run(self.config, self.out, self.mesh.world_size, self.options).handed
                self.out = claim_run_dir(self.out, resume=self.resume, overwrite=self.overwrite)
                self._stack.callback(run_lock.release, self.out)
                self.job.prepare(self.config, self.out)
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
        if not self.resume:
            manifest["digest"] = digest_settings()
            manifest.update(self.job.manifest_extra(self.config, self.options, self.checked))
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
        if self.options.audit_verified:  # what the launcher read: this rank's writer does not read it again
            mark_known(self.out, self.mesh.rank, self.options.audit_verified)
        self.recorder = self.closing(
            Recorder(
                self.out,
                model,
                level=audit.level,
                modules=audit.modules,
                flush_every_steps=audit.flush_every_steps,
                stats=audit.stats,
                writes_microbatches=self.mesh.tp_rank == 0,  # TP peers hold the same microbatches
                # DDP: every rank holds the same parameters, gradients and moments; each hashes 1/W
                split_replicated=self.mesh.tp == 1 and getattr(self.config.parallel, "mode", "dp") == "dp",
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
