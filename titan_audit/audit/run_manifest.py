"""RUN/manifest.json: the one reader and writer every layer uses.

Guarantees: `write_manifest` writes atomically (temp + rename) with a format version;
`read_manifest` returns a JSON object or raises a ValueError naming the run directory or file
(missing directory, not a run, invalid JSON, not an object, a newer format). `digest_settings`
is what a run's manifest says of how its records were hashed (key `digest`), and
`digest_differences` why two runs' records need not compare for that reason alone.
The run's writer lock is audit/run_lock.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_json_atomic
from titan_audit.audit.fingerprint import whole_hash_bytes
from titan_audit.batch_invariant.cpu import lattice

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


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


def digest_settings() -> dict[str, int]:
    """How this process hashes records (audit/fingerprint.py): the lattice version above C, and C."""
    return {"lattice": lattice.version(), "whole_hash_bytes": whole_hash_bytes()}


def digest_differences(
    manifest_a: dict[str, Any], manifest_b: dict[str, Any], names: tuple[str, str] = ("A", "B"), *, differed: bool
) -> list[str]:
    """Why two runs' records of equal tensors may differ because of how they were hashed ([] when
    nothing says so). A manifest without `digest` was written before runs named it (lattice
    version 1 above 2 MiB); that is said only when the records `differed`, since below C nothing
    changed."""
    a, b = manifest_a.get("digest"), manifest_b.get("digest")
    if a == b:
        return []
    if a is None or b is None:
        if not differed:
            return []
        old = names[0] if a is None else names[1]
        return [
            f"{old} was recorded before manifests named their digest (lattice version 1 above C = 2 MiB): its "
            "records of tensors above C differ from this version's even where the tensors are equal"
        ]
    return [f"the records were hashed differently (digest: {a} -> {b}): records of tensors above C need not compare"]
