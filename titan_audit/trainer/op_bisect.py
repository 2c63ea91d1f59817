"""`bisect --step N`: the first aten op at which two runs part in step N, by re-running that step.

    comparison = bisect_step("runs/a", "runs/b", step=7)   # audit.OpLogComparison

Guarantees:
- A run's op log for step N is RUN/oplogs/step_N.parquet when the run recorded one. Otherwise step
  N is re-run: the run's latest checkpoint before N is copied into a temporary run directory
  (trainer.replay.prepare_replay: the source run is only read), resumed in this process on one
  rank, and step N's forward, backward, gradient reduction and optimizer update run under
  DebugMode (audit.oplog): every aten op in order, with the xxh3-128 hashes of its inputs and
  outputs and the module it ran in.
- One rank is enough for any run: by G3 the step's bits are those of every world size dividing V,
  so two runs are compared on the same footing whatever W they were trained at.
- Both logs are compared with audit.compare_op_logs: the first op whose outputs differ, the phase it
  ran in (forward, backward, optimizer: inside the optimizer's step, or other: loss, reduction,
  clipping outside any module) and what its inputs say: identical tensors and scalar arguments (the
  op itself is not reproducible), tensor inputs already different (the difference came from the
  checkpoint or the data: that op is its first consumer), or a scalar argument that differs, with
  both values (the op is not the origin: the number was computed upstream, outside the logged ops,
  e.g. the learning rate of a changed schedule).
- Bad input (no such run, N outside the run's recorded steps, no checkpoint before N) is a
  ValueError before any work.
- Progress: a bar on stderr (titan_audit/progress.py: a terminal only) counts the stages (each
  re-run, then the comparison) and names the one running.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from titan_audit.audit import OpLogComparison, compare_op_logs
from titan_audit.audit.oplog import oplog_path
from titan_audit.progress import progress_bar
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import TrainConfig, from_dict
from titan_audit.trainer.replay import last_recorded_step, prepare_replay
from titan_audit.trainer.run_dir import read_manifest


def rerun_checkpoint(run: Path, step: int) -> int:
    """The checkpoint a re-run of `step` starts from: the run's latest one before it."""
    last = last_recorded_step(run)
    if not 1 <= step <= last:
        raise ValueError(f"{run}: step {step} is outside the run's recorded steps 1..{last}")
    before = [s for s in Checkpointer(run).steps() if s < step]
    if not before:
        raise ValueError(
            f"{run}: no checkpoint before step {step} to re-run it from "
            f"(checkpoints: {Checkpointer(run).steps() or 'none'})"
        )
    return max(before)


def step_op_log(run: str | os.PathLike, step: int, work: str | os.PathLike) -> tuple[Path, str]:
    """(RUN's op log of `step`, how to name it in a report): the recorded one, else one made by
    re-running the step into `work` (named by its run, since `work` is temporary)."""
    run = Path(run)
    recorded = oplog_path(run, f"step_{step}")
    if recorded.is_file():
        return recorded, str(recorded)
    saved = typed_config.fill_added_keys(TrainConfig, read_manifest(run)["config"])  # old runs: gemm order v1
    config = from_dict(saved, f"{run}/manifest.json config")
    from_step = rerun_checkpoint(run, step)
    replay = prepare_replay(run, from_step, Path(work))
    from titan_audit.trainer.train import train

    train(config, replay, resume=True, stop_at=step, quiet=True, oplog_step=step)
    return oplog_path(replay, f"step_{step}"), f"{run} step {step} (re-run from checkpoint step_{from_step})"


def bisect_step(run_a: str | os.PathLike, run_b: str | os.PathLike, step: int) -> OpLogComparison:
    """Compare step `step` of two runs op by op (recorded op logs, or re-runs; see the module doc)."""
    runs = [Path(run_a), Path(run_b)]
    # the checkpoint each run's re-run starts from (None: a recorded op log); every input checked before any work
    starts = [None if oplog_path(run, f"step_{step}").is_file() else rerun_checkpoint(run, step) for run in runs]
    with (
        tempfile.TemporaryDirectory(prefix="titan-audit-bisect-") as tmp,
        progress_bar(f"bisect step {step}", total=sum(s is not None for s in starts) + 1, unit="stage") as bar,
    ):
        logs = []
        for run, start, work in zip(runs, starts, ("a", "b"), strict=True):
            if start is not None:
                bar.describe(f"bisect: re-running {run.name} step {step} from step_{start}")
            logs.append(step_op_log(run, step, Path(tmp) / work))
            bar.done(n=int(start is not None))
        bar.describe(f"bisect step {step}: comparing the op logs")
        comparison = compare_op_logs(logs[0][0], logs[1][0])
        bar.done()
    return dataclasses.replace(comparison, log_a=logs[0][1], log_b=logs[1][1])
