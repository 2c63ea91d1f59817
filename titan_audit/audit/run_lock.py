"""RUN/.lock: the one writer of a run directory, taken by the trainer and asked about by readers.

Guarantees: `lock` takes an exclusive `fcntl.flock` on `RUN/.lock` and writes the holder's pid
there; a second process is refused at once with a ValueError naming the holder's pid and command.
The kernel drops the lock when its holder dies (even by SIGKILL), so a stale `.lock` file never
blocks. A process may nest its own lock (`release` undoes one `lock`), and a rank started by a
launcher that holds it inherits it through `LOCK_ENV` (the locked path). `run_writer` /
`is_being_written` ask whether a live process holds it, without taking it and without writing.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from titan_audit.audit.run_manifest import MANIFEST

LOCK = ".lock"
LOCK_ENV = "TITAN_AUDIT_RUN_LOCK"  # the run directory a parent launcher holds the lock of
_held: dict[str, tuple[int, int]] = {}  # resolved run dir -> (lock file descriptor, nesting count)


def lock(path: str | os.PathLike) -> None:
    """Take (or nest) this process's lock of the directory `path` (see the module docstring)."""
    path = Path(path)
    key = os.path.realpath(path)
    if key in _held:
        fd, count = _held[key]
        _held[key] = (fd, count + 1)
        return
    if os.environ.get(LOCK_ENV) == key:  # our launcher holds it for the whole run
        _held[key] = (-1, 1)
        return
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        holder = _describe_holder(int(text) if text.isdigit() else None)
        raise ValueError(f"{path}: {holder} is writing this run; wait for it to end or stop it first") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = (fd, 1)


def release(path: str | os.PathLike) -> None:
    """Undo one `lock` of this process (the lock goes with the last one)."""
    key = os.path.realpath(path)
    if key not in _held:
        return
    fd, count = _held.pop(key)
    if count > 1:
        _held[key] = (fd, count - 1)
    elif fd >= 0:
        os.close(fd)  # closing the only descriptor releases the flock


def move_lock(old: str | os.PathLike, new: str | os.PathLike) -> None:
    """`old` was moved aside with its lock file: drop that lock and take `new`'s, same nesting."""
    fd, count = _held.pop(os.path.realpath(old))
    if fd >= 0:
        os.close(fd)
    lock(new)
    key = os.path.realpath(new)
    _held[key] = (_held[key][0], count)


def lock_existing_run(path: str | os.PathLike) -> bool:
    """Take (or nest) this process's lock of `path` when it holds a run (True; undo with
    `release`), else nothing (False); ValueError naming the holder when another live process has it."""
    if not (Path(path) / MANIFEST).is_file():
        return False
    lock(path)
    return True


def _describe_holder(pid: int | None) -> str:
    if pid is None:
        return "another process"
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        command = " ".join(" ".join(w.decode(errors="replace").split()) for w in words if w)
    except OSError:
        command = ""
    return f"process {pid}" + (f" ({command[:120]})" if command else "")


def run_writer(run_dir: str | os.PathLike) -> str | None:
    """Who is writing the run now ("process 1234"), or None when no live process holds its lock.

    Probes `RUN/.lock` with a non-blocking shared flock on a descriptor of its own, released at
    once: it fails exactly while a writer holds the exclusive lock (a stale `.lock` file reads as
    None). Nothing is created or written. A lock held by this very process (through another
    descriptor) also counts as a writer."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: nobody ever claimed the run (or not a run at all)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # a file system without flock: cannot tell, do not block
            text = os.pread(fd, 64, 0).decode(errors="replace").strip()
            return f"process {text}" if text.isdigit() else "another process"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def is_being_written(run_dir: str | os.PathLike) -> bool:
    """True while a live process holds the run's writer lock (see `run_writer`)."""
    return run_writer(run_dir) is not None
