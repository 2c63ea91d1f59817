"""A stopped launcher (`titan-audit train --nproc 2`): SIGTERM ends the ranks, removes the launch's
temporary directory, says in one line how to resume and exits 143; the run then resumes. A
launcher killed by SIGKILL leaves a directory the next launcher removes, never a live one's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from titan_audit.trainer.config import load_config
from titan_audit.trainer.launch import LaunchOptions, launch_dirs, supervisor
from titan_audit.trainer.train import TRAIN_JOB

CLI = [sys.executable, "-m", "titan_audit.cli"]


def _wait_for(condition, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _processes_naming(path: Path) -> list[str]:
    """Command lines of live processes (not this one) that name `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if str(path) in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_ranks_cleans_up_and_the_run_resumes(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    run = tmp_path / "RUN"
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    common = ["--out", str(run), "--set", "parallel.threads=1"]
    stderr_file = tmp_path / "stderr.txt"
    with stderr_file.open("wb") as stderr:
        proc = subprocess.Popen(
            [
                *CLI,
                "train",
                "--config",
                "tiny-dense",
                "--steps",
                "50",
                "--nproc",
                "2",
                *common,
                "--set",
                "checkpoint.interval=1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            _wait_for(lambda: any((run / "checkpoints").glob("step_*")), 90, "a first checkpoint")
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 143
    lines = stderr_file.read_text().splitlines()
    assert lines, "nothing on stderr"
    assert lines[-1].startswith("Error: stopped by SIGTERM; the run in ") and str(run) in lines[-1], lines[-1]
    assert "--resume" in lines[-1]
    assert all(line.startswith("[rank ") for line in lines[:-1]), lines  # rank logs only: no torchrun report
    assert not list(tmpdir.glob("titan-audit-launch-*"))
    _wait_for(lambda: not _processes_naming(run), 10, f"no process left: {_processes_naming(run)}")

    last = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert f"step {last})" in lines[-1]
    done = subprocess.run(  # in this process (W=1: a resume may change W, G3): no torchrun to wait for
        [*CLI, "train", "--resume", "--steps", str(last + 1), *common],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (run / "checkpoints" / f"step_{last + 1:08d}").is_dir()
    assert not list(tmpdir.glob("titan-audit-launch-*"))


def test_stale_launch_dirs_of_dead_launchers_are_removed_never_live_ones(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def launch_dir(name: str, token: str | None) -> Path:
        path = tmp_path / f"{launch_dirs.LAUNCH_DIR_PREFIX}{name}"
        (path / "errors").mkdir(parents=True)
        (path / "config.json").write_text("{}")
        if token is not None:
            (path / launch_dirs.LAUNCH_PID_FILE).write_text(token)
        return path

    gone = launch_dir("dead", f"{dead.pid}\n")
    alive = launch_dir("alive", launch_dirs.owner_token(os.getpid()))
    alive_no_start = launch_dir("alive-pid-only", f"{os.getpid()}\n")
    no_pid = launch_dir("being-made", None)
    other = tmp_path / "titan-audit-ranks-x"
    other.mkdir()
    reused = None
    if launch_dirs.process_start(os.getpid()) is not None:  # same pid, another process start time: a reused pid
        reused = launch_dir("reused", f"{os.getpid()} 1\n")

    removed = launch_dirs.remove_stale_launch_dirs(tmp_path)

    assert sorted(removed) == sorted(p for p in (gone, reused) if p is not None)
    assert not gone.exists()
    assert alive.is_dir() and alive_no_start.is_dir() and no_pid.is_dir() and other.is_dir()
    assert reused is None or not reused.exists()


def test_stopped_message_says_where_a_resume_starts(tmp_path: Path) -> None:
    assert "nothing to resume" in supervisor.stopped_message(signal.SIGINT, tmp_path / "none")
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    assert supervisor.stopped_message(signal.SIGTERM, run) == (
        f"stopped by SIGTERM; the run in {run} can be resumed with --resume (no checkpoint yet: from step 0)"
    )
    (run / "checkpoints" / "step_00000008").mkdir(parents=True)
    assert "(from its last checkpoint, step 8)" in supervisor.stopped_message(signal.SIGHUP, run)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_a_stop_signal_exits_128_plus_it_with_one_line_and_restores_the_handlers(
    tmp_path: Path, monkeypatch, capsys, signum: int, code: int
) -> None:
    """torchrun() without torchrun: the stop reaches the launch (a stand-in), the temp dir of
    the launch goes, one line, SystemExit(128 + signal); a signal inside `held()` waits for its end."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}
    seen = []

    def stand_in(job, config, out, options, signals, **kwargs):
        with signals.held():
            os.kill(os.getpid(), signum)
            seen.append("held")  # reached: the stop waits for the block's end
        seen.append("after")  # never reached
        return 0

    monkeypatch.setattr(supervisor, "_torchrun", stand_in)
    with pytest.raises(SystemExit) as stopped:
        supervisor.torchrun(TRAIN_JOB, load_config("tiny-dense"), tmp_path / "RUN", LaunchOptions(), nproc=2)
    assert stopped.value.code == code
    assert seen == ["held"]
    err = capsys.readouterr().err.splitlines()
    name = signal.Signals(signum).name
    run = tmp_path / "RUN"
    assert err == [
        f"Error: stopped by {name} before the run in {run} wrote its manifest; nothing to resume: start it again"
    ]
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_launch_dir_holds_the_pid_and_is_removed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = {}

    def fake_run(command, env, errors):
        directory = errors.parent
        seen["pid"] = (directory / launch_dirs.LAUNCH_PID_FILE).read_text().split()[0]
        seen["name"] = directory.name
        return 0

    monkeypatch.setattr(supervisor, "_run_filtered", fake_run)
    assert supervisor.torchrun(TRAIN_JOB, load_config("tiny-dense"), tmp_path / "RUN", LaunchOptions(), nproc=2) == 0
    assert seen["pid"] == str(os.getpid()) and seen["name"].startswith(launch_dirs.LAUNCH_DIR_PREFIX)
    assert not list(tmp_path.glob(f"{launch_dirs.LAUNCH_DIR_PREFIX}*"))
