"""Start a training run on N local ranks through torchrun, or in this process.

`start_run(source, out, ...)` is what `titan-audit train` runs: it resolves the config (a recipe
or TOML file with `--set` overrides; on a resume without a source, the run's own config from its
manifest; with `--init`, the model section takes the init's shape: trainer/init.py), checks the
run directory before any work (rank 0), then launches.

`launch(config, out, nproc=N, ...)` writes the resolved config to a temporary JSON file and runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m titan_audit.trainer.rank_entry
...` as a subprocess (rank_entry.py: a module nothing imports, so runpy never finds it already
imported and warns); it returns torchrun's exit code (0 ok, else a crash). The ranks' intra-op thread
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
- A stopped launcher stops its ranks and cleans up: on SIGTERM, SIGHUP or SIGINT (Ctrl-C) it sends
  SIGTERM to torchrun (which sends it to the ranks), waits for it a bounded time
  (`STOP_GRACE_S`) and then kills it (the ranks die with it), drops what torchrun and the ranks
  print from then on, removes its temporary directory, releases the run's lock and prints one line
  (`Error: stopped by SIGTERM; the run in RUN can be resumed with --resume (from its last
  checkpoint, step N)`, or that there is nothing to resume yet); it exits 128 + the signal number
  (143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C) by raising SystemExit. The run resumes from
  its last checkpoint like after any crash (checkpoints are atomic, G5).
- No temporary directory outlives its launcher for long: a launcher's `titan-audit-launch-*`
  directory holds a `pid` file (its pid and process start time); SIGKILL cannot be handled, so
  every launcher first removes the `titan-audit-launch-*` directories (its own user's, in the
  system temp dir) whose owner process is gone, and never one whose owner is alive (a directory
  without a `pid` file is kept: its owner may be writing it).

Multi-node (`Rendezvous`: --nnodes N --node-rank R --rdzv-endpoint HOST:PORT, with --nproc P
ranks per node, W = N * P): every node runs the same command but --node-rank, and torchrun joins
them through its c10d rendezvous (`--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`
instead of `--standalone`); node 0 hosts the rendezvous store (`is_host=true`), so HOST:PORT is
node 0's address. --node-rank is not passed to torchrun (its c10d backend ignores it: global ranks
follow the nodes' host names and pids), it says which launcher does the run directory's work.
- Shared filesystem: every node reads and writes the same run directory at the same path (rank 0
  writes the manifest, metrics and checkpoints, and may run on any node; every rank reads the
  checkpoint on a resume).
- Node 0 alone claims the run's lock and runs the pre-launch checks (`check_run` with W = N * P:
  resume compatibility, overwrite, the checkpoint's small files); the ranks of every node treat the
  lock as their launcher's (TITAN_AUDIT_RUN_LOCK), so the one that is rank 0 does not take it a
  second time. A node R > 0 never claims: it checks the request itself (config vs W, data, init;
  with --resume, that a run is there) and leaves the run directory alone. Flags other than
  --node-rank must match on every node (every node passes --resume on a resume): a mismatch is
  not detected across nodes.
- A lost node (killed, crashed, its network gone) makes the ranks of the others fail in their next
  collective: each writes a `peer` report to its launcher's error directory and every surviving
  launcher drops torchrun's report, prints one line (`Error: ... lost its connection ...; resume
  the run in RUN with --resume (...)`) and returns 1; torchrun and its ranks have exited by then.
  A SIGKILLed node closes its sockets and is noticed at once; a machine that vanishes without
  closing them is noticed at the process group's timeout (gloo's default).
- The checkpoints are W-invariant (G5): a multi-node run resumes on one node, at any W.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from titan_audit.log import get_logger
from titan_audit.trainer.config import RECIPES, TrainConfig, from_dict, to_dict


@dataclass(frozen=True)
class Rendezvous:
    """Where this launcher's node sits in a multi-node launch (see the module docstring)."""

    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT of node 0, where the c10d rendezvous store listens

    @classmethod
    def from_options(
        cls, nnodes: int | None, node_rank: int | None, endpoint: str | None, *, nproc: int | None
    ) -> Rendezvous | None:
        """The launch's rendezvous from the CLI's flags (None: one node, `--standalone`);
        ValueError naming the flag for a bad combination."""
        if nnodes is None:
            for flag, value in (("--node-rank", node_rank), ("--rdzv-endpoint", endpoint)):
                if value is not None:
                    raise ValueError(f"{flag} needs --nnodes (the number of nodes)")
            return None
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if endpoint is None:
            raise ValueError("--nnodes needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if nproc is None:
            raise ValueError("--nnodes needs --nproc (the ranks per node)")
        node_rank = 0 if node_rank is None else node_rank
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank} is outside [0, {nnodes}) for --nnodes {nnodes}")
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port in 1..65535")
        return cls(nnodes, node_rank, endpoint)

    @property
    def main_node(self) -> bool:
        """Node 0: the run directory's lock and checks are its launcher's."""
        return self.node_rank == 0

    def torchrun_args(self) -> list[str]:
        is_host = "true" if self.main_node else "false"
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-conf=is_host={is_host}",
        ]


AUTO_NPROC = "auto"


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_nproc(nproc: int | str | None, config, rendezvous: Rendezvous | None = None) -> int | None:  # noqa: ANN001
    """`--nproc` as the launch takes it: N, None (in this process), or for "auto" the largest
    W <= usable cores / parallel.threads that the config accepts (parallel.tp divides it and
    `config.check_world_size(W)` passes), None when that is 1. The trajectory is the same at every
    W (G3), so the choice is about speed only; it is logged. ValueError for N < 1, another
    string, or "auto" with a multi-node launch (give the ranks per node there)."""
    if nproc is None or isinstance(nproc, int):
        if nproc is not None and nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        return nproc
    if nproc != AUTO_NPROC:
        raise ValueError(f"--nproc must be a number >= 1 or {AUTO_NPROC!r}, got {nproc!r}")
    if rendezvous is not None:
        raise ValueError(f"--nproc {AUTO_NPROC} is for one node; with --nnodes give the ranks per node")
    cores, threads = usable_cores(), config.parallel.threads
    for world_size in range(max(cores // threads, 1), 0, -1):
        if world_size % config.parallel.tp:
            continue
        try:
            config.check_world_size(world_size)
        except ValueError:
            continue
        get_logger(__name__).info(
            "--nproc auto: W=%d (%d usable cores, parallel.threads=%d, parallel.tp=%d)",
            world_size,
            cores,
            threads,
            config.parallel.tp,
        )
        return world_size if world_size > 1 else None
    raise ValueError(
        f"--nproc {AUTO_NPROC}: no world size <= {max(cores // threads, 1)} fits the config "
        f"(parallel.tp = {config.parallel.tp}); give --nproc N"
    )


def world_size_of(nproc: int | None, rendezvous: Rendezvous | None) -> int:
    """The launch's W: nnodes * nproc; in-process, torchrun's WORLD_SIZE (else 1)."""
    if nproc is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return nproc * (rendezvous.nnodes if rendezvous is not None else 1)


def check_other_node(out: str | os.PathLike, *, resume: bool) -> None:
    """What a node R > 0 checks of the run directory (it claims nothing): a resume needs a run."""
    from titan_audit.trainer.run_dir import MANIFEST, is_run_dir

    if resume and not is_run_dir(Path(out)):
        raise ValueError(f"{out}: no run to resume ({MANIFEST} not found; the run directory must be shared)")


def resolve_config(
    source: str | None, out: Path, *, resume: bool, overrides: Sequence[str], init: str | os.PathLike | None = None
) -> TrainConfig:
    """`source` (a recipe name or a TOML file) with `overrides` (KEY=VALUE); with no source on a
    resume, the config saved in `out`'s manifest with the overrides applied. With `init` (--init),
    the model section takes the init's shape (trainer/init.py)."""
    from titan_audit.trainer.init import resolve_config as resolve

    return resolve(
        TrainConfig, RECIPES, "recipe", source, out, kind="train", resume=resume, overrides=overrides, init=init
    )


def start_run(
    source: str | None,
    out: Path,
    *,
    nproc: int | str | None,
    steps: int | None,
    resume: bool,
    overwrite: bool | str,
    overrides: Sequence[str],
    init: str | os.PathLike | None = None,
    rendezvous: Rendezvous | None = None,
    until: str | None = None,
) -> int:
    """Resolve the config, check `out` (rank 0, before any work), train; torchrun's exit code.
    `nproc`: N ranks, None (this process) or "auto" (`resolve_nproc`).
    `init`: start from another run's latest checkpoint or an HF model directory (trainer/init.py).
    `until`: a stop condition (trainer/until.py), checked here before any rank starts.
    `rendezvous`: this node of a multi-node launch (node R > 0 checks the request, not `out`)."""
    from titan_audit.trainer.train import check_inputs, check_run
    from titan_audit.trainer.until import parse_until

    if until is not None:
        parse_until(until)
    main_node = rendezvous is None or rendezvous.main_node
    with existing_run_locked(out) if main_node else contextlib.nullcontext():
        if not main_node:
            check_other_node(out, resume=resume)
        config = resolve_config(
            source,
            out,
            resume=resume,
            overrides=[*overrides, *([f"steps={steps}"] if steps is not None else [])],
            init=init,
        )
        nproc = resolve_nproc(nproc, config, rendezvous)
        world_size = world_size_of(nproc, rendezvous)
        if not main_node:
            check_inputs(config, world_size, init)
        elif int(os.environ.get("RANK", "0")) == 0:
            check_run(config, out, resume=resume, overwrite=overwrite, world_size=world_size, init=init)
        return launch(
            config, out, nproc=nproc, resume=resume, overwrite=overwrite, init=init, rendezvous=rendezvous, until=until
        )


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
    overwrite: bool | str = False,
    stop_at: int | None = None,
    quiet: bool = False,
    init: str | os.PathLike | None = None,
    rendezvous: Rendezvous | None = None,
    until: str | None = None,
) -> int:
    if nproc is None:
        assert rendezvous is None, "a multi-node launch goes through torchrun"
        from titan_audit.trainer.train import train

        train(config, out, resume=resume, overwrite=overwrite, stop_at=stop_at, quiet=quiet, init=init, until=until)
        return 0
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
    if stop_at is not None:
        flags.append(f"stop_at={stop_at}")
    if init is not None:
        flags.append(f"init={os.fspath(init)}")
    if until is not None:
        flags.append(f"until={until}")
    return torchrun(
        RANK_ENTRY,
        to_dict(config),
        out,
        flags,
        nproc=nproc,
        threads=config.parallel.threads,
        resume=resume,
        overwrite=overwrite,
        rendezvous=rendezvous,
    )


RANK_ENTRY = "titan_audit.trainer.rank_entry"  # what torchrun runs on each rank: `main` below
ERROR_DIR_ENV = "TITAN_AUDIT_ERROR_DIR"  # where ranks write their user error (set by torchrun())
LAUNCHER_ENV = "TITAN_AUDIT_LAUNCHER_PID"  # the launcher's pid: ranks die with it
NNODES_ENV = "TITAN_AUDIT_NNODES"  # set by a multi-node launch: a lost peer is reported as one line
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
    overwrite: bool | str = False,
    rendezvous: Rendezvous | None = None,
) -> int:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE CONFIG_JSON OUT
    FLAGS...` with the resolved config in a temporary JSON file and OMP_NUM_THREADS = `threads`,
    under this process's lock of `out` (claimed with `resume` / `overwrite`); torchrun's exit code,
    or a ValueError with a rank's user error (see the module docstring). MODULE's `main` reads
    those arguments (see `rank_main`). Stopped by SIGTERM, SIGHUP or SIGINT: one line on stderr and
    SystemExit(128 + signal number), after the ranks are gone and the temporary directory removed.
    With `rendezvous`: the c10d flags instead of --standalone; node R > 0 claims no lock; a lost
    node is one line on stderr and exit code 1 (see the module docstring)."""
    remove_stale_launch_dirs()
    signals = _StopSignals()
    try:
        with signals:
            return _torchrun(
                module,
                config,
                out,
                flags,
                signals,
                nproc=nproc,
                threads=threads,
                resume=resume,
                overwrite=overwrite,
                rendezvous=rendezvous,
            )
    except _Stopped as stop:
        print(f"Error: {stopped_message(stop.signum, out)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop.signum) from None


def _torchrun(
    module: str,
    config: dict,
    out: str | os.PathLike,
    flags: Sequence[str],
    signals: _StopSignals,
    *,
    nproc: int,
    threads: int,
    resume: bool,
    overwrite: bool | str,
    rendezvous: Rendezvous | None,
) -> int:
    from titan_audit.trainer.run_dir import LOCK_ENV, run_lock

    main_node = rendezvous is None or rendezvous.main_node
    claim = run_lock(out, resume=resume, overwrite=overwrite) if main_node else contextlib.nullcontext()
    nodes = rendezvous.torchrun_args() if rendezvous is not None else ["--standalone"]

    with signals.held():  # a stop now would leave a directory without its pid file
        tmp = Path(tempfile.mkdtemp(prefix=LAUNCH_DIR_PREFIX))
        (tmp / LAUNCH_PID_FILE).write_text(_owner_token(os.getpid()))
    try:
        with claim:
            config_file = tmp / "config.json"
            config_file.write_text(json.dumps(config))
            errors = tmp / "errors"
            errors.mkdir()
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *nodes,
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
                LOCK_ENV: os.path.realpath(out),  # node 0's launcher holds it (multi-node: shared filesystem)
                **({NNODES_ENV: str(rendezvous.nnodes)} if rendezvous is not None else {}),
            }
            rc = _run_filtered(command, env, errors)
            message = _rank_error(errors)
            if message is not None:
                raise ValueError(message)
            lost = _rank_error(errors, kind="peer")
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
    except _Stopped:
        _stop_torchrun(proc)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


STOP_GRACE_S = 20.0  # how long a stopped launcher waits for torchrun (and its ranks) after SIGTERM
LAUNCH_DIR_PREFIX = "titan-audit-launch-"
LAUNCH_PID_FILE = "pid"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


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


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux: /proc/PID/stat field 22), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _owner_token(pid: int) -> str:
    start = _process_start(pid)
    return f"{pid} {start}\n" if start is not None else f"{pid}\n"


def _owner_alive(token: str) -> bool:
    """Whether the process a launch directory's pid file names is still running (a reused pid,
    seen by a different start time, is not)."""
    parts = token.split()
    pid = int(parts[0])
    if not _alive(pid):
        return False
    if len(parts) > 1:
        start = _process_start(pid)
        return start is None or start == parts[1]
    return True


def remove_stale_launch_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the `titan-audit-launch-*` directories in `root` (default: the system temp dir) of
    this user whose launcher is gone (see the module docstring); the directories removed."""
    root = Path(root if root is not None else tempfile.gettempdir())
    removed = []
    for path in root.glob(f"{LAUNCH_DIR_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            token = (path / LAUNCH_PID_FILE).read_text()
            if _owner_alive(token):
                continue
        except (OSError, ValueError, IndexError):  # no pid file (yet), unreadable: kept
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            get_logger(__name__).info("removed %s: its launcher (pid %s) is gone", path, token.split()[0])
    return removed


def _rank_error(errors: Path, kind: str = "user") -> str | None:
    """The lowest rank's message among the reports of `kind` ("user": a user error; "peer": a
    lost connection to another node's rank), None without one."""
    reports = []
    for file in errors.glob("rank-*.json"):
        try:
            report = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if report.get("kind", "user") == kind:
            reports.append(report)
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
    the error is printed once (rank 0) and exits 2. The process group is destroyed either way; a rank
    that finished exits 0 without interpreter teardown."""
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
    except Exception as error:
        lost = _lost_peer(error)
        error_dir = os.environ.get(ERROR_DIR_ENV)
        if lost is None or not error_dir:
            raise
        rank = int(os.environ.get("RANK", "0"))
        from titan_audit.atomic import write_json_atomic

        report = {"rank": rank, "kind": "peer", "message": f"rank {rank} {lost}"}
        write_json_atomic(Path(error_dir) / f"rank-{rank}.json", report, overwrite=True)
        os._exit(1)  # the process group cannot be torn down without its peers
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    # Done: leave without interpreter teardown, as trainer/local_ranks.py does. Gloo threads of the
    # groups a DeviceMesh created (parallel.tp > 1) can still be alive then and abort the rank
    # ("terminate called without an active exception", seen in CI under load), and torchrun then
    # kills its peers. The run's files are written and the process group is destroyed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def _lost_peer(error: BaseException) -> str | None:
    """In a multi-node launch (NNODES_ENV), an error that says a peer rank is gone: the message's
    tail (without the peer's node, the rank cannot know why), else None."""
    import torch.distributed as dist

    nnodes = int(os.environ.get(NNODES_ENV, "1"))
    if nnodes < 2 or not isinstance(error, (dist.DistError, RuntimeError)):
        return None
    text = str(error)
    if not isinstance(error, dist.DistError) and not any(w in text.lower() for w in _LOST_PEER_WORDS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (
        f"lost its connection to another rank: a node of this {nnodes}-node run died or was stopped, "
        f"see its output ({type(error).__name__}: {first[:200]})"
    )


def main(argv: list[str] | None = None, wrap: Callable[[Callable], Callable] | None = None) -> None:
    """Entry point of one training rank under torchrun: `python -m titan_audit.trainer.rank_entry
    CONFIG_JSON OUT [resume] [overwrite] [quiet] [stop_at=N] [init=PATH] [until=SPEC]` (`launch` writes the
    resolved config to a JSON file). `wrap`: the rank's work goes through `wrap(run)` (a live-bytes
    tracker, trainer/rank_entry.py)."""
    from titan_audit.trainer.train import train

    def run(config: dict, out: str, flags: set[str]) -> None:
        stop_at = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("stop_at=")), None)
        init = next((f.split("=", 1)[1] for f in flags if f.startswith("init=")), None)
        until = next((f.split("=", 1)[1] for f in flags if f.startswith("until=")), None)
        resume, overwrite, quiet = "resume" in flags, "overwrite" in flags, "quiet" in flags
        train(
            from_dict(config),
            out,
            resume=resume,
            overwrite=overwrite,
            stop_at=stop_at,
            quiet=quiet,
            init=init,
            until=until,
        )

    rank_main(sys.argv[1:] if argv is None else argv, run if wrap is None else wrap(run))
