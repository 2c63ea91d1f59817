"""The launcher's side of a torchrun launch: it starts torchrun, watches it, stops it, cleans up.

Guarantees:
- One writer per run directory: node 0's launcher holds the run's lock for the whole launch (the
  ranks treat it as theirs through TITAN_AUDIT_RUN_LOCK), so a second launch of a live run is
  refused at once, naming the pid.
- User errors are one line: a rank's report (rank.py) makes the launcher drop torchrun's own
  report (ChildFailedError block, the tracebacks of the ranks the failure took down) and raise the
  lowest rank's message as a ValueError; a lost node of a multi-node launch is one line and exit
  1. Without a report (a real crash) everything printed stays visible and torchrun's exit code is
  returned.
- A stopped launcher (SIGTERM, SIGHUP, SIGINT) sends SIGTERM to torchrun, waits `STOP_GRACE_S`,
  then kills it (the ranks die with it), drops what is printed from then on, removes its launch
  directory, releases the lock, prints where a resume would start and exits 128 + the signal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from titan_audit.trainer.launch.launch_dirs import (
    LAUNCH_DIR_PREFIX,
    LAUNCH_PID_FILE,
    owner_token,
    remove_stale_launch_dirs,
    torchrun_preexec,
)
from titan_audit.trainer.launch.rank import ERROR_DIR_ENV, LAUNCHER_ENV, NNODES_ENV, read_report
from titan_audit.trainer.launch.rendezvous import Rendezvous
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions, write_launch_file

STOP_GRACE_S = 20.0  # how long a stopped launcher waits for torchrun (and its ranks) after SIGTERM
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def torchrun(
    job: JobSpec,
    config: Any,
    out: str | os.PathLike,
    options: LaunchOptions,
    *,
    nproc: int,
    rendezvous: Rendezvous | None = None,
) -> int:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m JOB.rank_entry
    LAUNCH_JSON OUT` with the launch file (`write_launch_file`: config and options, whole) in a
    temporary directory and OMP_NUM_THREADS = `parallel.threads` (never from N), under this
    process's lock of `out`; torchrun's exit code, or a ValueError with a rank's user error (see
    the module docstring). Stopped by SIGTERM, SIGHUP or SIGINT: one line on stderr and
    SystemExit(128 + signal number), after the ranks are gone and the temporary directory removed.
    With `rendezvous`: the c10d flags instead of --standalone; node R > 0 claims no lock."""
    remove_stale_launch_dirs()
    signals = _StopSignals()
    try:
        with signals:
            return _torchrun(job, config, out, options, signals, nproc=nproc, rendezvous=rendezvous)
    except _Stopped as stop:
        print(f"Error: {stopped_message(stop.signum, out)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop.signum) from None


def _torchrun(
    job: JobSpec,
    config: Any,
    out: str | os.PathLike,
    options: LaunchOptions,
    signals: _StopSignals,
    *,
    nproc: int,
    rendezvous: Rendezvous | None,
) -> int:
    from titan_audit.audit.run_lock import LOCK_ENV
    from titan_audit.trainer.run_dir import claimed_run_dir

    main_node = rendezvous is None or rendezvous.main_node
    claim = (
        claimed_run_dir(out, resume=options.resume, overwrite=options.overwrite)
        if main_node
        else contextlib.nullcontext()
    )
    nodes = rendezvous.torchrun_args() if rendezvous is not None else ["--standalone"]

    with signals.held():  # a stop now would leave a directory without its pid file
        tmp = Path(tempfile.mkdtemp(prefix=LAUNCH_DIR_PREFIX))
        (tmp / LAUNCH_PID_FILE).write_text(owner_token(os.getpid()))
    try:
        with claim:
            launch_file = tmp / "launch.json"
            write_launch_file(launch_file, job, config, options)
            errors = tmp / "errors"
            errors.mkdir()
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *nodes,
                f"--nproc-per-node={nproc}",
                "-m",
                job.rank_entry,
                str(launch_file),
                os.fspath(out),
            ]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(config.parallel.threads),
                ERROR_DIR_ENV: str(errors),
                LAUNCHER_ENV: str(os.getpid()),
                LOCK_ENV: os.path.realpath(out),  # node 0's launcher holds it (multi-node: shared filesystem)
                **({NNODES_ENV: str(rendezvous.nnodes)} if rendezvous is not None else {}),
            }
            rc = _run_filtered(command, env, errors)
            message = read_report(errors)
            if message is not None:
                raise ValueError(message)
            lost = read_report(errors, kind="peer")
            if lost is not None:
                print(f"Error: {lost}; {resume_hint(out)}", file=sys.stderr, flush=True)
                return 1
            return rc
    finally:
        with signals.held():  # removed whole: never a directory left without its pid file
            shutil.rmtree(tmp, ignore_errors=True)


def _run_filtered(command: list[str], env: dict[str, str], errors: Path) -> int:
    """Run torchrun with its stderr passed through as it comes, until a rank reports a user error
    (a file in `errors`): from then on torchrun's report of the failure is dropped. Stopped
    (`_Stopped`, from a signal): torchrun gets SIGTERM and `STOP_GRACE_S` to end, then SIGKILL;
    its output from then on is dropped; `_Stopped` propagates."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, preexec_fn=torchrun_preexec(os.getpid()))
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
    except _Stopped:
        _stop_torchrun(proc)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


class _Stopped(BaseException):
    """A stop signal reached the launcher (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """While entered (main thread only; elsewhere nothing changes): SIGTERM, SIGHUP and SIGINT
    raise `_Stopped` once; later ones are ignored while the launcher stops. Inside `held()` a
    signal waits until the block ends. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self._old: dict[int, object] = {}
        self._holding = 0
        self._pending: int | None = None
        self._stopping = False

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in _STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._old = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self._stopping:
            return
        if self._holding:
            self._pending = signum
            return
        self._stopping = True
        raise _Stopped(signum)

    @contextlib.contextmanager
    def held(self):
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if not self._holding and self._pending is not None and not self._stopping:
            self._stopping = True
            raise _Stopped(self._pending)


def _stop_torchrun(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun (it forwards it to the ranks), its output drained and dropped for at
    most STOP_GRACE_S, then SIGKILL (the ranks die with it: PDEATHSIG)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def stopped_message(signum: int, out: str | os.PathLike) -> str:
    """What a stopped launch tells the user about the run in `out`: where a resume starts."""
    from titan_audit.trainer.run_dir import is_run_dir

    name = signal.Signals(signum).name
    out = Path(out)
    if not is_run_dir(out):
        return f"stopped by {name} before the run in {out} wrote its manifest; nothing to resume: start it again"
    return f"stopped by {name}; the run in {out} can be resumed with --resume ({_resume_point(out)})"


def resume_hint(out: str | os.PathLike) -> str:
    """Where a resume of the run in `out` would start, for a failed launch's one line."""
    from titan_audit.trainer.run_dir import is_run_dir

    out = Path(out)
    if not is_run_dir(out):
        return f"the run in {out} wrote no manifest yet; nothing to resume: start it again"
    return f"resume the run in {out} with --resume ({_resume_point(out)})"


def _resume_point(out: Path) -> str:
    from titan_audit.trainer.checkpoint import Checkpointer

    try:
        steps = Checkpointer(out).steps()
    except OSError:
        steps = []
    return f"from its last checkpoint, step {steps[-1]}" if steps else "no checkpoint yet: from step 0"
