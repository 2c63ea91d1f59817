"""One rank of a launch: `rank_main` runs the job's loop from the launch file torchrun passes on.

Guarantees: the rank reads its config and `LaunchOptions` typed from the launch file (a file of
another job kind is refused). Started by a launcher, it dies with it; a user error
(`faults.user_errors()`) goes as a one-line report to the launcher's error directory (the launcher
prints the lowest rank's, exit 2), and in a multi-node launch a lost peer is a `peer` report
(exit 1); under another torchrun rank 0 prints the line itself. The process group is destroyed
either way, and a rank that finished exits 0 without interpreter teardown.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from titan_audit import faults
from titan_audit.trainer.launch.launch_dirs import die_with_parent
from titan_audit.trainer.launch.spec import JobSpec, read_launch_file

ERROR_DIR_ENV = "TITAN_AUDIT_ERROR_DIR"  # where ranks write their reports (set by the supervisor)
LAUNCHER_ENV = "TITAN_AUDIT_LAUNCHER_PID"  # the launcher's pid: ranks die with it
NNODES_ENV = "TITAN_AUDIT_NNODES"  # set by a multi-node launch: a lost peer is reported as one line
_LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def rank_main(job: JobSpec, argv: Sequence[str], wrap: Callable[[Callable], Callable] | None = None) -> None:
    """One rank's entry under torchrun: `LAUNCH_JSON OUT`; runs `job.run(config, out, options)`,
    through `wrap(job.run)` when given (a live-bytes tracker, trainer/rank_entry.py)."""
    import torch.distributed as dist

    from titan_audit.log import configure, verbose_from_env

    if LAUNCHER_ENV in os.environ:
        die_with_parent(int(os.environ[LAUNCHER_ENV]))
    configure()  # this rank's logs: rank 0 at INFO, every rank with the CLI's -v (TITAN_AUDIT_VERBOSE)
    out = argv[1]
    work = job.run if wrap is None else wrap(job.run)
    try:
        config, options = read_launch_file(job, Path(argv[0]))
        work(config, out, options)
    except faults.user_errors() as error:
        if verbose_from_env():
            traceback.print_exc()
        path = error.filename if isinstance(error, OSError) and error.filename is not None else out
        message = faults.user_message(error, path)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if os.environ.get(ERROR_DIR_ENV):
            _report(rank, "user", message)
        elif rank == 0:
            print(f"Error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as error:
        lost = _lost_peer(error)
        if lost is None or not os.environ.get(ERROR_DIR_ENV):
            raise
        rank = int(os.environ.get("RANK", "0"))
        _report(rank, "peer", f"rank {rank} {lost}")
        os._exit(1)  # the process group cannot be torn down without its peers
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    # Done: leave without interpreter teardown, as trainer/local_ranks.py does. Gloo threads of the
    # groups a DeviceMesh created (parallel.tp > 1) can still be alive then and abort the rank
    # ("terminate called without an active exception"), and torchrun then kills its peers. The
    # run's files are written and the process group is destroyed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(rank: int, kind: str, message: str) -> None:
    """This rank's report to its launcher: RANK's file in the error directory."""
    from titan_audit.atomic import write_json_atomic

    report: dict[str, Any] = {"rank": rank, "kind": kind, "message": message}
    write_json_atomic(Path(os.environ[ERROR_DIR_ENV]) / f"rank-{rank}.json", report, overwrite=True)


def read_report(errors: Path, kind: str = "user") -> str | None:
    """The lowest rank's message among the reports of `kind` in `errors` ("user": a user error;
    "peer": a lost connection to another node's rank), None without one."""
    reports = []
    for file in errors.glob("rank-*.json"):
        try:
            report = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if report.get("kind", "user") == kind:
            reports.append(report)
    if not reports:
        return None
    return min(reports, key=lambda r: r.get("rank", 0))["message"]


def _lost_peer(error: BaseException) -> str | None:
    """In a multi-node launch (NNODES_ENV), an error that says a peer rank is gone: the message's
    tail (without the peer's node, the rank cannot know why), else None."""
    import torch.distributed as dist

    nnodes = int(os.environ.get(NNODES_ENV, "1"))
    if nnodes < 2 or not isinstance(error, (dist.DistError, RuntimeError)):
        return None
    text = str(error)
    if not isinstance(error, dist.DistError) and not any(w in text.lower() for w in _LOST_PEER_WORDS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (
        f"lost its connection to another rank: a node of this {nnodes}-node run died or was stopped, "
        f"see its output ({type(error).__name__}: {first[:200]})"
    )
