"""The golden store: a small, self-verifying copy of part of a run, kept to check later runs against.

A golden directory (format version 1):

    GOLDEN/golden.json                          format marker and version, what was kept (steps,
                                                phases, metrics), the tolerance policy, the size
                                                and sha256 of every other file, and a sha256 of
                                                its own canonical content
    GOLDEN/manifest.json                        the source run's manifest (config, numerics
                                                fingerprint, package versions, world-size history)
    GOLDEN/metrics.parquet                      step + the kept metric columns (zstd)
    GOLDEN/audit/part-r00000-00000000.parquet   the kept audit records (audit.schema, zstd),
                                                sorted in execution order

The layout is also a (minimal) run directory, so `titan-audit compare GOLDEN RUN` works on it.

Guarantees:
- `read_golden` returns a golden only after verifying it: golden.json parses, carries the format
  marker, is not from a newer format version, and its canonical content hashes to its recorded
  sha256; every listed file exists with the recorded size and sha256, and no other file sits in
  the directory. The self-hash rule (sha256 of golden.json's JSON content without its `sha256`
  key, keys sorted, no whitespace) is the same in every format version and is checked before
  the version; then golden.json must be byte-identical to the rendering this version writes
  (so even a lost trailing newline is caught). Any failure of the integrity checks raises
  `GoldenCorrupt` (a ValueError naming the file), never a numerics verdict: a flipped byte or a
  truncated file is corruption.
- Bad input is a ValueError naming the path: a directory that does not exist, one that is not a
  golden (no golden.json, or no format marker), a golden from a newer format version.
- `write_golden` builds the whole directory under a temporary name and renames it into place
  (titan_audit.atomic), so a crash never leaves half a golden; it refuses an existing golden
  unless `overwrite=True` (the `update` path).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from titan_audit.atomic import atomic_output_dir
from titan_audit.audit.run_metrics import read_metrics
from titan_audit.audit.schema import PHASE_RANK, SCHEMA

FORMAT = "titan-audit-golden"
FORMAT_VERSION = 1
GOLDEN_JSON = "golden.json"
MANIFEST = "manifest.json"
METRICS = "metrics.parquet"
AUDIT_PART = "audit/part-r00000-00000000.parquet"

# The cheap phases: one record per tensor of the data, the loss and the model state per step.
# forward/backward (one record per module output) and ckpt (depends on the checkpoint interval)
# are left out by default.
DEFAULT_PHASES: tuple[str, ...] = ("rollout", "data", "logprob", "loss", "grad", "optim", "param")
# Metrics compared by default (when the run has them), and their tolerance-mode bounds.
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "loss": {"rtol": 1e-3, "atol": 1e-5},
    "grad_norm": {"rtol": 2e-2, "atol": 1e-5},
    "lr": {"rtol": 1e-9, "atol": 0.0},
    "aux_loss": {"rtol": 1e-3, "atol": 1e-5},  # MoE load balancing (trainer metrics of MoE runs)
}
DEFAULT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-5}  # for a metric named explicitly without bounds


class GoldenCorrupt(ValueError):
    """A golden file failed its integrity check (bad input: exit 2, never a numerics verdict)."""


@dataclass
class Tolerance:
    """Tolerance-mode policy: per-metric bounds |run - golden| <= atol + rtol * |golden|, and a
    failure budget: at most `max_failures` (metric, step) points may be outside their bounds."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    max_failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"metrics": copy.deepcopy(self.metrics), "max_failures": self.max_failures}

    @classmethod
    def from_dict(cls, data: Any, source: str) -> Tolerance:
        if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
            raise GoldenCorrupt(f"{source}: key 'tolerance' is not an object with 'metrics'")
        metrics: dict[str, dict[str, float]] = {}
        for name, bounds in data["metrics"].items():
            if not isinstance(bounds, dict) or set(bounds) != {"rtol", "atol"}:
                raise GoldenCorrupt(f"{source}: tolerance.metrics.{name} must have exactly rtol and atol")
            metrics[name] = {k: float(v) for k, v in bounds.items()}
        max_failures = data.get("max_failures", 0)
        if not isinstance(max_failures, int) or max_failures < 0:
            raise GoldenCorrupt(f"{source}: tolerance.max_failures must be an integer >= 0")
        return cls(metrics, max_failures)


@dataclass
class Golden:
    """A verified golden directory (see the module docstring)."""

    path: Path
    meta: dict[str, Any]
    manifest: dict[str, Any]
    audit: pa.Table
    metrics: pa.Table | None
    tolerance: Tolerance

    @property
    def steps(self) -> list[int]:
        return list(self.meta["steps"])

    @property
    def phases(self) -> list[str]:
        return list(self.meta["phases"])

    @property
    def fingerprint(self) -> dict[str, Any] | None:
        fp = self.manifest.get("fingerprint")
        return fp if isinstance(fp, dict) else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical(meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _render(meta: dict[str, Any]) -> bytes:
    """The exact bytes of golden.json (format version 1)."""
    return (json.dumps(meta, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


def sort_records(table: pa.Table) -> pa.Table:
    """Audit records in execution order (step, phase order, microbatch, seq, name)."""
    ranks = pa.array([PHASE_RANK.get(p, len(PHASE_RANK)) for p in table["phase"].to_pylist()], type=pa.int32())
    table = table.append_column("_phase_rank", ranks)
    order = [
        ("step", "ascending"),
        ("_phase_rank", "ascending"),
        ("phase", "ascending"),
        ("microbatch", "ascending"),
        ("seq", "ascending"),
        ("name", "ascending"),
    ]
    return table.sort_by(order).drop_columns(["_phase_rank"])


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", compression_level=19)


def write_golden(
    path: str | os.PathLike,
    *,
    audit: pa.Table,
    metrics: pa.Table | None,
    manifest: dict[str, Any],
    steps: list[int],
    phases: list[str],
    tolerance: Tolerance,
    source_run: str,
    overwrite: bool = False,
) -> Path:
    """Write a golden directory atomically; refuses an existing `path` unless overwrite."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ValueError(
            f"{path} already exists; a golden is only replaced deliberately: use `titan-audit golden update`"
        )
    audit = sort_records(audit.select(SCHEMA.names).cast(SCHEMA))
    with atomic_output_dir(path, overwrite=overwrite) as tmp:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a golden is meant to be shared
        files: dict[str, dict[str, Any]] = {}
        _write_parquet(audit, tmp / AUDIT_PART)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n")
        names = [AUDIT_PART, MANIFEST]
        if metrics is not None:
            _write_parquet(metrics, tmp / METRICS)
            names.append(METRICS)
        for name in sorted(names):
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        meta: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "source_run": source_run,
            "steps": sorted(steps),
            "phases": sorted(phases, key=lambda p: PHASE_RANK.get(p, len(PHASE_RANK))),
            "records": audit.num_rows,
            "metric_columns": [] if metrics is None else [c for c in metrics.column_names if c != "step"],
            "tolerance": tolerance.to_dict(),
            "files": files,
        }
        meta["sha256"] = hashlib.sha256(_canonical(meta)).hexdigest()
        (tmp / GOLDEN_JSON).write_bytes(_render(meta))
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """golden.json of the golden at `path`, checked (format, version, self-hash); no file checks."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such golden directory")
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory (expected a golden directory)")
    meta_path = path / GOLDEN_JSON
    if not meta_path.is_file():
        raise ValueError(f"{path}: not a golden directory ({GOLDEN_JSON} not found)")
    raw = meta_path.read_bytes()
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GoldenCorrupt(f"{meta_path}: corrupt golden file (not valid JSON: {error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        # A flipped byte inside the marker itself lands here too; the self-hash below cannot help
        # without the marker, so say both.
        raise GoldenCorrupt(f"{meta_path}: not a titan-audit golden or corrupt (key 'format' is not {FORMAT!r})")
    # The self-hash rule is the same in every format version, so it is checked first: a flipped
    # digit in format_version is corruption, not a "newer version".
    recorded = meta.get("sha256")
    try:
        actual = hashlib.sha256(_canonical(meta)).hexdigest()
    except ValueError:  # a non-finite number: cannot be ours
        actual = None
    if recorded != actual:
        raise GoldenCorrupt(f"{meta_path}: corrupt golden file (content sha256 {actual} != recorded {recorded})")
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise GoldenCorrupt(f"{meta_path}: corrupt golden file (missing or invalid key 'format_version')")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: golden format version {version} is newer than this titan-audit understands "
            f"({FORMAT_VERSION}); upgrade titan-audit"
        )
    if raw != _render(meta):  # same content, other bytes: truncated whitespace, a hand edit
        raise GoldenCorrupt(
            f"{meta_path}: corrupt golden file (bytes differ from the canonical rendering of its content)"
        )
    for key, kind in (("steps", list), ("phases", list), ("files", dict), ("tolerance", dict)):
        if not isinstance(meta.get(key), kind):
            raise GoldenCorrupt(f"{meta_path}: corrupt golden file (key {key!r} missing or not a {kind.__name__})")
    return meta


def _verify_files(path: Path, meta: dict[str, Any]) -> None:
    files: dict[str, Any] = meta["files"]
    for name, info in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise GoldenCorrupt(f"{file}: golden file missing (listed in {GOLDEN_JSON})")
        size = file.stat().st_size
        if size != info.get("bytes"):
            raise GoldenCorrupt(
                f"{file}: corrupt golden file (size {size} bytes, recorded {info.get('bytes')}: truncated?)"
            )
        digest = sha256_file(file)
        if digest != info.get("sha256"):
            raise GoldenCorrupt(f"{file}: corrupt golden file (sha256 {digest} != recorded {info.get('sha256')})")
    listed = set(files) | {GOLDEN_JSON}
    extra = sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in listed
    )
    if extra:
        raise GoldenCorrupt(f"{path}: files not listed in {GOLDEN_JSON}: {', '.join(extra)}")
    if AUDIT_PART not in files or MANIFEST not in files:
        raise GoldenCorrupt(f"{path / GOLDEN_JSON}: corrupt golden file ({AUDIT_PART} or {MANIFEST} not listed)")


def read_golden(path: str | os.PathLike) -> Golden:
    """The golden at `path`, fully verified (see the module docstring)."""
    path = Path(path)
    meta = read_meta(path)
    _verify_files(path, meta)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        audit = pq.read_table(path / AUDIT_PART)
        metrics = read_metrics(path) if METRICS in meta["files"] else None
    except (json.JSONDecodeError, pa.ArrowInvalid, OSError, ValueError) as error:  # hashes matched: a writer bug
        raise GoldenCorrupt(f"{path}: golden files verified but unreadable ({error})") from None
    missing = [c for c in SCHEMA.names if c not in audit.column_names]
    if missing:
        raise GoldenCorrupt(f"{path / AUDIT_PART}: not an audit table (missing {', '.join(missing)})")
    tolerance = Tolerance.from_dict(meta["tolerance"], str(path / GOLDEN_JSON))
    return Golden(path, meta, manifest, audit.select(SCHEMA.names).cast(SCHEMA), metrics, tolerance)


def within(run: float, golden: float, rtol: float, atol: float) -> bool:
    """|run - golden| <= atol + rtol * |golden|; a NaN or infinity passes only if both are the
    same non-finite value (never by tolerance)."""
    if not (math.isfinite(run) and math.isfinite(golden)):
        return (math.isnan(run) and math.isnan(golden)) or run == golden
    return abs(run - golden) <= atol + rtol * abs(golden)
