"""Atomic outputs: a file or directory appears under its final name complete, or not at all.

Shared by every package that writes run, data, checkpoint or golden files (no titan_audit imports:
it sits below every layer).

Guarantees: `write_bytes_atomic` writes to a temporary sibling, fsyncs it and renames it over the
target, so a crash leaves the old file or the new one, never half of one. `atomic_output_dir`
builds a directory under a temporary sibling name and renames it into place on success; on an
exception the temporary directory is removed. Both refuse an existing target unless
`overwrite=True` (then the old target is replaced only after the new one is complete).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
