"""Test tools for faults of the machine: a read-only tree or a full disk made by failing the write
calls themselves (CI runs as root, which ignores permission bits, so `chmod` proves nothing), a
byte-for-byte snapshot of a directory, and the one-line-error assertion.

`failing_writes(monkeypatch, root, code)` makes every call that would create, write, rename or
remove something under `root` raise OSError(code) naming the path, as the kernel would: `open`
and `os.open` with a write mode, `os.mkdir`, `os.rename`/`os.replace`, `os.unlink`/`os.rmdir`. Reads
still work. Only this process is affected (torchrun ranks are not): in-process runs only.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path

import xxhash

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _under(path, root: Path) -> bool:
    if isinstance(path, int):
        return False
    try:
        resolved = Path(os.path.abspath(os.fspath(path)))
    except TypeError:
        return False
    return resolved == root or root in resolved.parents


def failing_writes(monkeypatch, root: str | os.PathLike, code: int = errno.EACCES) -> None:
    root = Path(os.path.abspath(root))

    def fail(path):
        raise OSError(code, os.strerror(code), os.fspath(path))

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and _under(file, root):
            fail(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS and _under(path, root):
            fail(path)
        return real_os_open(path, flags, *args, **kwargs)

    def one_path(real):
        def guarded(path, *args, **kwargs):
            if _under(path, root) and kwargs.get("dir_fd") is None:
                fail(path)
            return real(path, *args, **kwargs)

        return guarded

    def two_paths(real):
        def guarded(src, dst, *args, **kwargs):
            for path in (src, dst):
                if _under(path, root):
                    fail(path)
            return real(src, dst, *args, **kwargs)

        return guarded

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    for name in ("mkdir", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, one_path(getattr(os, name)))
    for name in ("rename", "replace"):
        monkeypatch.setattr(os, name, two_paths(getattr(os, name)))


def snapshot(root: str | os.PathLike) -> dict[str, str]:
    """Every entry under `root` -> xxh3 of its bytes ("dir" for a directory; the lock file's
    presence counts, its pid text does not)."""
    root = Path(root)
    out = {}
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_dir():
            out[key] = "dir"
        elif path.name == ".lock":
            out[key] = "lock"
        else:
            out[key] = xxhash.xxh3_64_hexdigest(path.read_bytes())
    return out


def one_line_error(result, *needles: str, code: int = 2) -> str:
    """Assert a click result is exit `code` with exactly one stderr line `Error: ...` holding every
    needle and no traceback; return that line."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("[rank ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in result.stderr
    return lines[0]
