"""RUN/manifest.json: the one reader and writer every layer uses.

Guarantees: `write_manifest` writes atomically (temp + rename) with a format version;
`read_manifest` returns a JSON object or raises a ValueError naming the run directory or file
(missing directory, not a run, invalid JSON, not an object, a newer format).
`is_being_written` / `run_writer` ask whether a live process holds the run's writer lock
(`RUN/.lock`, taken with an exclusive fcntl.flock by trainer.run_dir) without taking it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_json_atomic

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
RUN_LOCK = ".lock"  # the writer's lock file (trainer.run_dir.LOCK): flock'ed exclusively, holds its pid


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ValueError(f"{run_dir}: not a run directory ({MANIFEST} not found)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if data.get("format", 0) > MANIFEST_FORMAT:
        raise ValueError(f"{path}: written by a newer titan-audit (format {data['format']})")
    return data


def write_manifest(run_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    write_json_atomic(Path(run_dir) / MANIFEST, {"format": MANIFEST_FORMAT, **manifest})


def record_census(run_dir: str | os.PathLike, mode: str) -> None:
    """Store this process's batch-invariant op census (`batch_invariant.census.summary()`: the
    native ops seen in BI mode, with counts, reasons and first call sites) in the manifest as
    `bi_census` {"mode": "strict" | "record" | "off", "native_ops_seen": {...} (None when off)}."""
    from titan_audit.batch_invariant import census

    manifest = read_manifest(run_dir)
    manifest.pop("format", None)
    manifest["bi_census"] = {"mode": mode, "native_ops_seen": None if mode == "off" else census.summary()}
    write_manifest(run_dir, manifest)


def run_writer(run_dir: str | os.PathLike) -> str | None:
    """Who is writing the run now ("process 1234"), or None when no live process holds its lock.

    Probes `RUN/.lock` with a non-blocking shared flock on a descriptor of its own, released at
    once: it fails exactly while a writer holds the exclusive lock (the kernel drops that lock
    when its holder dies, so a stale `.lock` file reads as None). Nothing is created or written.
    A lock held by this very process (through another descriptor) also counts as a writer."""
    path = Path(run_dir) / RUN_LOCK
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
