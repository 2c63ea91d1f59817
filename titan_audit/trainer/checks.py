"""The input checks every run makes before it computes: the device and backend, the run directory.

Guarantees: each raises a ValueError naming the key or the path, reads no tensor and writes
nothing; a resume is checked against its saved config (only the loop's mutable keys may differ),
its checkpoints' small files, the step it would start from and the audit log's tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_audit.audit.log import check_audit_log
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.metrics_out import check_logging
from titan_audit.trainer.run_dir import check_out_path, read_manifest


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


@dataclass(frozen=True)
class RunChecked:
    """What a job's run check found: the audit-log parts a resume's check read and found intact
    (audit/log.py LogCheck.verified; empty for a new run), and what it hands the loop (RL: the task)."""

    audit_verified: dict[str, list[int | str]]
    handed: Any = None


def check_run_dir(
    config: Any,
    out: Path,
    *,
    kind: str,
    mutable: frozenset[str],
    resume: bool,
    overwrite: bool | str,
    known: dict[str, list[int | str]] | None = None,
) -> dict[str, list[int | str]]:
    """The run directory against the request (ValueError; no compute, nothing written): --resume
    and --overwrite exclude each other; a resume needs a run of the same kind whose saved config
    differs only in `mutable` keys, checkpoints whose small files verify, an audit log whose parts
    all read, and a step to run; a new
    run needs an empty (or missing) directory unless --overwrite, outside any other run's
    directory and without runs below it (run_dir.check_out_path). The metrics streams the run
    writes there must be available (metrics_out.check_logging: TensorBoard installed). Returns
    the audit-log parts read and found intact (none for a new run); parts `known` holds (an
    earlier check's) are not read again while unchanged."""
    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    check_logging(config)
    if resume:
        saved = saved_manifest(out, kind)
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
        return check_audit_log(out, after_step=start, mark=False, known=known).verified
    check_out_path(out, overwrite=overwrite)
    return {}


def saved_manifest(out: Path, kind: str) -> dict[str, Any]:
    """The manifest of the run in `out`, which must be a `kind` run (ValueError naming both)."""
    saved = read_manifest(out)
    saved_kind = saved.get("kind", "train")
    if saved_kind != kind:
        what = {"train": "a train run", "rl": "an RL run"}
        raise ValueError(
            f"{out}: {what.get(saved_kind, saved_kind)}, not {what[kind]} (use `titan-audit {saved_kind} --resume`)"
        )
    return saved
