"""Atomic outputs: a file or directory appears under its final name complete, or not at all.

Shared by every package that writes run, data, checkpoint or golden files (no titan_audit imports:
it sits below every layer).

Guarantees:
- `write_bytes_atomic` writes to a temporary sibling, fsyncs it and renames it over the target,
  so a crash leaves the old file or the new one, never half of one. `atomic_output_dir` builds a
  directory under a temporary sibling name (`.NAME.XXXX.tmp`) and renames it into place on
  success; on an exception the temporary directory is removed. Both refuse an existing target
  unless `overwrite=True` (then the old target is replaced only after the new one is complete).
- Outputs get the modes the umask gives a plain `open()` / `mkdir()`: files 0666 & ~umask,
  directories 0777 & ~umask (not the private 0600 / 0700 of `mkstemp` / `mkdtemp`). The umask
  is read from /proc/self/status on Linux, elsewhere by setting and restoring it under a lock.
- Temporaries a killed writer left (kill -9 cannot be cleaned up after) are removed by the next
  writer of the same output that holds `output_lock(path)`: an exclusive `fcntl.flock` on
  `.NAME.lock` next to the output (the holder's pid written in it), held for the whole write. A
  second writer of the same output is refused at once (ValueError naming the holder's pid), so
  the `.NAME.*.tmp` / `.NAME.*.old` siblings found under the lock belong to no live writer that
  takes it. The kernel drops the lock when its holder dies, so a stale lock file never blocks;
  the holder removes the lock file when it is done.
  Use it for an output all of whose writers take it (data/ token stores do).
- `move_aside(path)` renames a directory to `NAME.replaced-<UTC time>` (`-2`, `-3`, ... when that
  name is taken, say by a second replacement in the same second), never onto anything that exists.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

_umask_lock = threading.Lock()


def current_umask() -> int:
    """This process's umask, without changing it where the OS tells (Linux /proc)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _umask_lock:  # os.umask can only be read by setting it: restore at once
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def _file_mode() -> int:
    return 0o666 & ~current_umask()


def _dir_mode() -> int:
    return 0o777 & ~current_umask()


def refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise ValueError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> None:
    path = Path(path)
    refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _file_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: object, *, overwrite: bool = True) -> None:
    """`obj` as indented JSON, written atomically (replacing `path` unless overwrite=False)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, default=str) + "\n").encode(), overwrite=overwrite)


@contextlib.contextmanager
def atomic_output_file(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it to `path` when the block succeeds."""
    path = Path(path)
    refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
    finally:
        os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; move it to `path` when the block succeeds."""
    path = Path(path)
    refuse_existing(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, _dir_mode())
        yield tmp
        if path.exists():  # overwrite=True: move the old one aside first, then drop it
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of output `path`: `.NAME.lock` next to it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """The temporary siblings of output `path` that `atomic_output_dir` / `atomic_output_file` /
    `write_bytes_atomic` make (`.NAME.XXXX.tmp`, `.NAME.XXXX.old`), sorted."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.(tmp|old)")  # tempfile's 8 random chars
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name))


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[list[Path]]:
    """Hold the exclusive lock of output `path` for the block and first remove the temporaries a
    dead writer of it left (see the module docstring); yields the paths removed. Another live
    holder: ValueError naming its pid. The lock file is removed again when the block ends (one a
    killed holder left is reused)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock_file(path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        removed = []
        for stale in stale_temporaries(path):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            if not stale.exists():
                removed.append(stale)
        yield removed
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(path))  # while still locked: a waiting opener sees another inode
        os.close(fd)  # drops the lock


def _lock_file(path: Path) -> int:
    """An open descriptor of `path`'s lock file, exclusively flocked; the file is the one the lock
    path names (not one a releasing holder has just unlinked)."""
    lock = lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, _file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"{path} is being written by another process (pid {holder}); wait for it or stop it"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it between our open and our flock: take the new one


def move_aside(path: str | os.PathLike) -> Path:
    """Rename the directory `path` to a fresh sibling `NAME.replaced-<UTC time>[-k]`; that name.

    The sibling is claimed with an exclusive mkdir first, so two replacements in one second (or two
    processes) never pick the same name; the rename then replaces only that empty claim (the moved
    directory keeps its own mode).
    """
    path = Path(path)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    for k in range(1, 10_000):
        aside = path.with_name(f"{path.name}.replaced-{stamp}" + (f"-{k}" if k > 1 else ""))
        try:
            os.mkdir(aside, 0o700)
        except FileExistsError:
            continue
        try:
            os.rename(path, aside)
        except BaseException:
            os.rmdir(aside)
            raise
        return aside
    raise ValueError(f"{path}: no free NAME.replaced-{stamp}-k name to move it aside to")
