"""Start a training run on N local ranks through torchrun, or in this process.

`start_run(source, out, ...)` is what `titan-audit train` runs: it resolves the config (a recipe
or TOML file with `--set` overrides; on a resume without a source, the run's own config from its
manifest), checks the run directory before any work (rank 0), then launches.

`launch(config, out, nproc=N, ...)` writes the resolved config to a temporary JSON file and runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m titan_audit.trainer.launch ...`
as a subprocess; it returns torchrun's exit code (0 ok, else a crash). The ranks' intra-op thread
count comes from `parallel.threads` (exported as OMP_NUM_THREADS too, so torchrun does not pick
one): never from N. `nproc=None` runs in this process: under an external torchrun the ranks join
the rendezvous that torchrun put in the environment; otherwise a single process.

Guarantees (shared by `titan-audit train` and `titan-audit rl`, both go through `torchrun()`):
- User errors reach the user as one line. What can be checked without compute is checked here,
  before torchrun starts (`train.check_run`: config vs W, resume compatibility, the checkpoint's
  small files and the step a resume starts from, data vs model). A user error a rank finds later
  (ValueError and the other bad-input types `cli/errors.py` lists) is written by `rank_main` to a
  per-rank file in the launch's temporary directory instead of being printed; the launcher then
  drops torchrun's own report (ChildFailedError block, tracebacks of the ranks the failure took
  down) and raises the lowest rank's message as a ValueError: exit 2, one line. Without such a
  file (a real crash) everything torchrun and the ranks printed stays visible and torchrun's exit
  code is returned.
- One writer per run directory: the launcher holds the run's lock (run_dir.claim_run_dir) for the
  whole launch, so a second `train --resume` of a live run is refused at once, naming the pid.
- Ranks die with their launcher: torchrun and every rank get PR_SET_PDEATHSIG = SIGKILL
  (Linux prctl), torchrun for the launcher, each rank for torchrun, and a rank whose launcher is
  already gone when it starts exits at once; `kill -9` of the launcher leaves nothing running.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from titan_audit.trainer.config import TrainConfig, from_dict, load_config, to_dict


def resolve_config(source: str | None, out: Path, *, resume: bool, overrides: Sequence[str]) -> TrainConfig:
    """`source` (a recipe name or a TOML file) with `overrides` (KEY=VALUE); with no source on a
    resume, the config saved in `out`'s manifest with the overrides applied."""
    from titan_audit.trainer.engine import resolve_config as resolve

    return resolve(TrainConfig, load_config, source, out, kind="train", resume=resume, overrides=overrides)


def start_run(
    source: str | None,
    out: Path,
    *,
    nproc: int | None,
    steps: int | None,
    resume: bool,
    overwrite: bool,
    overrides: Sequence[str],
) -> int:
    """Resolve the config, check `out` (rank 0, before any work), train; torchrun's exit code."""
    from titan_audit.trainer.train import check_run

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    with existing_run_locked(out):
        config = resolve_config(
            source, out, resume=resume, overrides=[*overrides, *([f"steps={steps}"] if steps is not None else [])]
        )
        world_size = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0:
            check_run(config, out, resume=resume, overwrite=overwrite, world_size=world_size)
        return launch(config, out, nproc=nproc, resume=resume, overwrite=overwrite)


@contextlib.contextmanager
def existing_run_locked(out: str | os.PathLike):
    """Hold the lock of `out` while checking it, when it exists (rank 0 / the launcher only):
    a run another live process writes is refused before anything reads it."""
    from titan_audit.trainer.run_dir import lock_run_dir, release_run_dir

    out = Path(out)
    if int(os.environ.get("RANK", "0")) != 0 or not lock_run_dir(out):
        yield
        return
    try:
        yield
    finally:
        release_run_dir(out)


def launch(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    nproc: int | None,
    resume: bool = False,
    overwrite: bool = False,
    stop_at: int | None = None,
    quiet: bool = False,
) -> int:
    if nproc is None:
        from titan_audit.trainer.train import train

        train(config, out, resume=resume, overwrite=overwrite, stop_at=stop_at, quiet=quiet)
        return 0
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
    if stop_at is not None:
        flags.append(f"stop_at={stop_at}")
    return torchrun(
        "titan_audit.trainer.launch",
        to_dict(config),
        out,
        flags,
        nproc=nproc,
        threads=config.parallel.threads,
        resume=resume,
        overwrite=overwrite,
    )


ERROR_DIR_ENV = "TITAN_AUDIT_ERROR_DIR"  # where ranks write their user error (set by torchrun())
LAUNCHER_ENV = "TITAN_AUDIT_LAUNCHER_PID"  # the launcher's pid: ranks die with it
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """PR_SET_PDEATHSIG = SIGKILL for this process (Linux; elsewhere nothing). If `parent_pid`
    is given and that process is already gone (it died before the call), exit at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and not _alive(parent_pid):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _torchrun_preexec(launcher: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:  # in the forked child, before exec: no imports, no allocation to speak of
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died between fork and prctl
            os._exit(1)

    return preexec


def torchrun(
    module: str,
    config: dict,
    out: str | os.PathLike,
    flags: Sequence[str],
    *,
    nproc: int,
    threads: int,
    resume: bool = False,
    overwrite: bool = False,
) -> int:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE CONFIG_JSON OUT
    FLAGS...` with the resolved config in a temporary JSON file and OMP_NUM_THREADS = `threads`,
    under this process's lock of `out` (claimed with `resume` / `overwrite`); torchrun's exit code,
    or a ValueError with a rank's user error (see the module docstring). MODULE's `main` reads
    those arguments (see `rank_main`)."""
    from titan_audit.trainer.run_dir import LOCK_ENV, run_lock

    with (
        tempfile.TemporaryDirectory(prefix="titan-audit-launch-") as tmp,
        run_lock(out, resume=resume, overwrite=overwrite),
    ):
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(config))
        errors = Path(tmp) / "errors"
        errors.mkdir()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            module,
            str(config_file),
            os.fspath(out),
            *flags,
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            ERROR_DIR_ENV: str(errors),
            LAUNCHER_ENV: str(os.getpid()),
            LOCK_ENV: os.path.realpath(out),
        }
        rc = _run_filtered(command, env, errors)
        message = _rank_error(errors)
        if message is not None:
            raise ValueError(message)
        return rc


def _run_filtered(command: list[str], env: dict[str, str], errors: Path) -> int:
    """Run torchrun with its stderr passed through as it comes, until a rank reports a user error
    (a file in `errors`): from then on torchrun's report of the failure is dropped."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, preexec_fn=_torchrun_preexec(os.getpid()))
    assert proc.stderr is not None
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    try:
        fd = proc.stderr.fileno()
        while chunk := os.read(fd, 1 << 16):
            if any(errors.iterdir()):
                continue
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def _rank_error(errors: Path) -> str | None:
    reports = []
    for file in errors.glob("rank-*.json"):
        try:
            reports.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            continue
    if not reports:
        return None
    return min(reports, key=lambda r: r.get("rank", 0))["message"]


def _user_error_types() -> tuple[type[BaseException], ...]:
    """What a rank reports as one line (cli/errors.py says the same at the CLI): bad input, a stale
    kernel build, and the machine's faults (OSError: a read-only run directory, a full disk)."""
    from titan_audit.batch_invariant.cpu import KernelLibraryError

    return (ValueError, KernelLibraryError, OSError)


def _error_message(error: BaseException, out: str) -> str:
    """The line a rank's error becomes: an OSError names its path and errno, its traceback saved
    in the run's logs/ (or the system temp dir) and named (titan_audit/faults.py)."""
    from titan_audit import faults

    if not isinstance(error, OSError):
        return str(error)
    return faults.describe(error, error.filename if error.filename is not None else out)


def rank_main(argv: Sequence[str], run: Callable[[dict, str, set[str]], object]) -> None:
    """One rank's entry point under `torchrun`: run(config dict, out, flags) from
    `CONFIG_JSON OUT FLAGS...`. Started by `torchrun()`: the rank dies with torchrun, and a user
    error goes to its error file (the launcher reports it) and exits 2. Under another torchrun:
    the error is printed once (rank 0) and exits 2. The process group is destroyed either way."""
    import torch.distributed as dist

    from titan_audit.log import configure, verbose_from_env

    if LAUNCHER_ENV in os.environ:
        die_with_parent(int(os.environ[LAUNCHER_ENV]))
    configure()  # this rank's logs: rank 0 at INFO, every rank with the CLI's -v (TITAN_AUDIT_VERBOSE)
    config = json.loads(Path(argv[0]).read_text())
    try:
        run(config, argv[1], set(argv[2:]))
    except _user_error_types() as error:
        if verbose_from_env():
            traceback.print_exc()
        message = _error_message(error, argv[1])
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
        error_dir = os.environ.get(ERROR_DIR_ENV)
        if error_dir:
            from titan_audit.atomic import write_json_atomic

            write_json_atomic(Path(error_dir) / f"rank-{rank}.json", {"rank": rank, "message": message}, overwrite=True)
        elif rank == 0:
            print(f"Error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point of one training rank under torchrun: `python -m titan_audit.trainer.launch
    CONFIG_JSON OUT [resume] [overwrite] [quiet] [stop_at=N]` (`launch` writes the resolved config
    to a JSON file)."""
    from titan_audit.trainer.train import train

    def run(config: dict, out: str, flags: set[str]) -> None:
        stop_at = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("stop_at=")), None)
        resume, overwrite, quiet = "resume" in flags, "overwrite" in flags, "quiet" in flags
        train(from_dict(config), out, resume=resume, overwrite=overwrite, stop_at=stop_at, quiet=quiet)

    rank_main(sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    main()
