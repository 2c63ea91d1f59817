"""A test hook that SIGKILLs this process at a named place, so tests can kill a run exactly there.

`TITAN_AUDIT_CRASH_AT=name:step[:rank]` (rank defaults to 0): `crash_point(name, step)` kills the
calling process with SIGKILL when name, step and rank match, and does nothing otherwise (one
environment lookup). Places: `train.after_step` (after step N's update and audit records),
`checkpoint.before_rename` (checkpoint N's files written and synced, directory not yet renamed),
and in rl/: `rl.rollout` (inside the generation of step N's rollouts) and `rl.after_step`.
"""

from __future__ import annotations

import os
import signal
import sys

CRASH_ENV = "TITAN_AUDIT_CRASH_AT"


def crash_point(name: str, step: int) -> None:
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{CRASH_ENV}={spec!r}: expected name:step or name:step:rank")
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if parts[0] == name and int(parts[1]) == step and rank == (int(parts[2]) if len(parts) == 3 else 0):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
