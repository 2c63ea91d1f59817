"""A test hook that kills this process, or makes an OS call fail, at a named place, so tests can
fault a run exactly there.

`TITAN_AUDIT_CRASH_AT=name:step[:rank[:ERRNO]]` (rank defaults to 0): `crash_point(name, step)`
does nothing unless name, step and rank match (one environment lookup); then it kills the calling
process with SIGKILL, or with an errno name (`ENOSPC`, `EACCES`, `EROFS`, ...) raises that
OSError as the write at that place would (the disk filled up, the directory became read-only).
Places: `train.after_step` (after step N's update and audit records), `checkpoint.before_rename`
(checkpoint N's files written and synced, directory not yet renamed), and in rl/: `rl.rollout`
(inside the generation of step N's rollouts) and `rl.after_step`.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

CRASH_ENV = "TITAN_AUDIT_CRASH_AT"


def crash_point(name: str, step: int, path: str | os.PathLike | None = None) -> None:
    """Fault here when TITAN_AUDIT_CRASH_AT says so; `path`: what an injected OSError names."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    parts = spec.split(":")
    numbers = all(part.isdigit() for part in parts[1:3])
    if len(parts) not in (2, 3, 4) or not numbers or (len(parts) == 4 and not hasattr(errno, parts[3])):
        raise ValueError(f"{CRASH_ENV}={spec!r}: expected name:step, name:step:rank or name:step:rank:ERRNO")
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if parts[0] != name or int(parts[1]) != step or rank != (int(parts[2]) if len(parts) >= 3 else 0):
        return
    if len(parts) == 4:
        code = getattr(errno, parts[3])
        raise OSError(code, os.strerror(code), None if path is None else os.fspath(path))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
