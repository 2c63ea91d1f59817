"""What outlives a launcher: its ranks (never) and its temporary directory (not for long).

Guarantees: torchrun and every rank get PR_SET_PDEATHSIG = SIGKILL (Linux), torchrun for the
launcher and each rank for torchrun, and a process whose parent is already gone exits at once, so
`kill -9` of a launcher leaves nothing running. A launcher's `titan-audit-launch-*` directory
holds a `pid` file (pid and process start time); every launcher first removes the directories of
its own user whose owner process is gone (a reused pid is told by its start time), never one whose
owner is alive, and keeps one without a `pid` file (its owner may be writing it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from titan_audit.log import get_logger

LAUNCH_DIR_PREFIX = "titan-audit-launch-"
LAUNCH_PID_FILE = "pid"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """PR_SET_PDEATHSIG = SIGKILL for this process (Linux; elsewhere nothing). If `parent_pid`
    is given and that process is already gone (it died before the call), exit at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and not alive(parent_pid):
        os._exit(1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def torchrun_preexec(launcher: int) -> Callable[[], None]:
    """What torchrun's forked child runs before exec: it dies with `launcher`."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:  # in the forked child, before exec: no imports, no allocation to speak of
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died between fork and prctl
            os._exit(1)

    return preexec


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc/PID/stat field 22), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def owner_token(pid: int) -> str:
    """What a launch directory's pid file holds: the pid and, where known, its start time."""
    start = process_start(pid)
    return f"{pid} {start}\n" if start is not None else f"{pid}\n"


def owner_alive(token: str) -> bool:
    """Whether the process a launch directory's pid file names is still running (a reused pid,
    seen by a different start time, is not)."""
    parts = token.split()
    pid = int(parts[0])
    if not alive(pid):
        return False
    if len(parts) > 1:
        start = process_start(pid)
        return start is None or start == parts[1]
    return True


def remove_stale_launch_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the `titan-audit-launch-*` directories in `root` (default: the system temp dir) of
    this user whose launcher is gone (see the module docstring); the directories removed."""
    root = Path(root if root is not None else tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{LAUNCH_DIR_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            token = (path / LAUNCH_PID_FILE).read_text()
            if owner_alive(token):
                continue
        except (OSError, ValueError, IndexError):  # no pid file (yet), unreadable: kept
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            get_logger(__name__).info("removed %s: its launcher (pid %s) is gone", path, token.split()[0])
    return removed
