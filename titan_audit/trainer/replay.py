"""Elastic replay: resume a run's checkpoint at step K in a new run directory (at any W dividing V)
and compare the replayed steps with the original, record for record.

    new_run = prepare_replay("runs/a", from_step=4, out="runs/a-w2")    # then train(..., resume=True)
    result = compare_replay("runs/a", "runs/a-w2", from_step=4, to_step=8)

Guarantees:
- The source run is only read. The new run directory gets the source's resolved config (in its
  manifest, with the source named under "replay_of"), a copy of the source's checkpoint `step_K`
  (verified again when the new run loads it) and of its prepared synthetic data, and nothing else;
  it is refused if it already holds anything, unless `overwrite` (then the old one is moved aside).
- `device` (`replay --device`): the replay runs on another `parallel.device` than the run (its
  backend back to "auto"), e.g. a cuda run's checkpoint on the CPU: the checkpoint loads into the
  other device's tensors bitwise (verified against its hashes), the new run's manifest holds the
  config it ran with, and the comparison shows what the other device's kernels changed.
- `compare_replay` compares exactly the steps K+1..to_step of both runs with audit.compare_runs
  (the same join on (step, phase, microbatch, name), nothing ignored): records of those steps only
  in one run count as differences.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.compute as pc

from titan_audit.audit import CompareResult, compare_runs, read_audit_log
from titan_audit.audit.log import AuditLogWriter
from titan_audit.audit.run_manifest import digest_settings
from titan_audit.audit.schema import SCHEMA
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import TrainConfig, from_dict, to_dict
from titan_audit.trainer.run_dir import MANIFEST, prepare_run_dir, read_manifest, write_manifest


def source_checkpoint(run: str | os.PathLike, from_step: int) -> tuple[TrainConfig, Path, int]:
    """(the run's config, checkpoint dir of step K, the run's last step); ValueError for bad input."""
    run = Path(run)
    manifest = read_manifest(run)
    # a run recorded before a key existed replays with the old behaviour (no bi_kernels: gemm order v1)
    config = from_dict(typed_config.fill_added_keys(TrainConfig, manifest["config"]), "manifest.json config")
    ckpt = Checkpointer(run)
    steps = ckpt.steps()
    if from_step not in steps:
        raise ValueError(f"{run}: no checkpoint at step {from_step} (checkpoints: {steps or 'none'})")
    last = last_recorded_step(run)
    if last <= from_step:
        raise ValueError(f"{run}: nothing to replay after step {from_step} (last recorded step {last})")
    return config, ckpt.path(from_step), last


def last_recorded_step(run: Path) -> int:
    table = read_audit_log(run, columns=["step"])
    if table.num_rows == 0:
        raise ValueError(f"{run}: the audit log is empty")
    return int(pc.max(table["step"]).as_py())


def prepare_replay(
    run: str | os.PathLike,
    from_step: int,
    out: str | os.PathLike,
    *,
    overwrite: bool | str = False,
    replay_config: TrainConfig | None = None,
) -> Path:
    """The new run directory of a replay (module docstring). `replay_config`: the replay's own
    config when it is not the run's (another device), written to the new manifest in place of the
    run's."""
    run, out = Path(run), Path(out)
    config, ckpt_dir, _ = source_checkpoint(run, from_step)
    if out.resolve() == run.resolve():
        raise ValueError(f"--out {out}: must differ from the replayed run")
    out = prepare_run_dir(out, resume=False, overwrite=overwrite)
    if config.data.store is None:
        shutil.copytree(run / "data", out / "data")
    target = Checkpointer(out).path(from_step)
    partial = target.with_name(f".{target.name}.copy")
    shutil.copytree(ckpt_dir, partial)
    os.replace(partial, target)
    source = read_manifest(run)
    write_manifest(
        out,
        {
            "config": source["config"] if replay_config is None else to_dict(replay_config),
            "seed": source.get("seed"),
            "world_size_history": [],
            "replay_of": {"run": str(run.resolve()), "from_step": from_step},
            "digest": digest_settings(),
        },
    )
    return out


def _steps_copy(run: Path, lo: int, hi: int, dest: Path) -> None:
    """dest/ as a run holding only run's audit records of steps lo..hi (and its manifest)."""
    table = read_audit_log(run)
    mask = pc.and_(pc.greater_equal(table["step"], lo), pc.less_equal(table["step"], hi))
    table = table.filter(mask).select(SCHEMA.names)
    (dest / "audit").mkdir(parents=True)
    if (run / MANIFEST).is_file():
        shutil.copy(run / MANIFEST, dest / MANIFEST)
    AuditLogWriter(dest).write({name: table[name].to_pylist() for name in SCHEMA.names})


def compare_replay(run: str | os.PathLike, replay: str | os.PathLike, from_step: int, to_step: int) -> CompareResult:
    run, replay = Path(run), Path(replay)
    with tempfile.TemporaryDirectory(prefix="titan-audit-replay-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        _steps_copy(run, from_step + 1, to_step, a)
        _steps_copy(replay, from_step + 1, to_step, b)
        result = compare_runs(a, b)
    result.run_a, result.run_b = str(run), str(replay)
    result.filters = {**result.filters, "steps": [from_step + 1, to_step]}
    return result


def elastic_replay(
    run: str | os.PathLike,
    from_step: int,
    out: str | os.PathLike,
    *,
    nproc: int = 1,
    tp: int | None = None,
    verify_to: int | None = None,
    overwrite: bool | str = False,
    quiet: bool = False,
    device: str | None = None,
) -> tuple[CompareResult, int]:
    """Resume `run`'s checkpoint `from_step` on `nproc` ranks into `out`, run to `verify_to` (default:
    the run's last step) and compare. `tp`: the replay's tensor-parallel degree (default: the
    run's; nproc = dp x tp), a layout like W (the checkpoint reshards through DCP). `device`: the
    replay's parallel.device (default: the run's; another one computes other bits). Returns
    (comparison, to_step). Bad input: ValueError, before any work; a failed replay run:
    RuntimeError."""
    from titan_audit.trainer.checks import check_backend
    from titan_audit.trainer.launch import LaunchOptions, launch
    from titan_audit.trainer.tensor_parallel import check_tensor_parallel
    from titan_audit.trainer.train import TRAIN_JOB

    config, _, last = source_checkpoint(run, from_step)
    other_device = device is not None and device != config.parallel.device
    if other_device:
        parallel = dataclasses.replace(config.parallel, device=device, backend="auto")
        config = dataclasses.replace(config, parallel=parallel)
        check_backend(config)  # cuda needs a GPU here
    if tp is not None:
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp=tp))
        check_tensor_parallel(config)
    to_step = last if verify_to is None else verify_to
    if not from_step < to_step <= last:
        raise ValueError(f"--verify-to {to_step}: must lie in {from_step + 1}..{last} (the run's recorded steps)")
    config.check_world_size(nproc)
    prepare_replay(run, from_step, out, overwrite=overwrite, replay_config=config if other_device else None)
    options = LaunchOptions(resume=True, stop_at=to_step, quiet=quiet)
    rc = launch(TRAIN_JOB, config, out, nproc=nproc if nproc > 1 else None, options=options)
    if rc:
        raise RuntimeError(f"the replay run failed (exit {rc}); see {out}")
    return compare_replay(run, out, from_step, to_step), to_step
