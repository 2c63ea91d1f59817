"""User errors under torchrun reach the user as one line, exit 2; a corrupt newest checkpoint falls
back; one writer per run directory; ranks die with their launcher (issue 17, point 3).

Every error case runs at --nproc 1 and --nproc 2 through the real CLI and checks: exit 2, exactly
one stderr line naming the file or key, no traceback and no torchrun ChildFailedError block, and
every file of the run unchanged (bytes hashed before and after). The negative controls: the same
commands without the fault succeed (the fallback resume, the second run after the first died).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner

from titan_audit.audit import compare_runs
from titan_audit.cli.main import cli

pytestmark = pytest.mark.slow

BASE = ["--config", "tiny-dense", "--set", "checkpoint.interval=1", "--set", "schedule.decay_steps=16"]
NPROCS = ["1", "2"]


def _cli(*args):
    """The CLI in this process (saves its import per call; --nproc still starts a real torchrun)."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def _snapshot(run: Path) -> dict[str, str]:
    """Every file of the run (the lock file aside) -> xxh3 of its bytes."""
    return {
        p.relative_to(run).as_posix(): xxhash.xxh3_64_hexdigest(p.read_bytes())
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _assert_one_line_exit_2(done, *needles):
    assert done.exit_code == 2, (done.exit_code, done.stderr, done.exception)
    assert isinstance(done.exception, SystemExit), done.exception  # a click error, not an escaped exception
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-rank run of 2 steps with checkpoints step_1 and step_2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    done = _cli("train", *BASE, "--steps", "2", "--nproc", "2", "--out", str(out))
    assert done.exit_code == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr, done.stderr  # runpy: the rank entry is imported by nothing
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    return out


def _copy(run: Path, dest: Path, keep_steps=(1, 2)) -> Path:
    shutil.copytree(run, dest)
    for p in (dest / "checkpoints").iterdir():
        if int(p.name.split("_")[1]) not in keep_steps:
            shutil.rmtree(p)
    return dest


def _flip_a_tensor_byte(ckpt: Path) -> None:
    part = sorted((ckpt / "model_optim").glob("*.distcp"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("nproc", NPROCS)
def test_resume_of_a_finished_run(finished, nproc):
    before = _snapshot(finished)
    done = _cli("train", "--out", str(finished), "--resume", "--nproc", nproc)
    _assert_one_line_exit_2(done, str(finished), "already at step 2")
    assert _snapshot(finished) == before


@pytest.mark.parametrize("nproc", NPROCS)
def test_incompatible_resume_names_the_key(finished, nproc):
    before = _snapshot(finished)
    done = _cli(
        "train", "--out", str(finished), "--resume", "--steps", "3", "--set", "optimizer.lr=0.5", "--nproc", nproc
    )
    _assert_one_line_exit_2(done, "optimizer.lr")
    assert _snapshot(finished) == before


@pytest.mark.parametrize("nproc", NPROCS)
def test_only_checkpoint_with_a_corrupt_trainer_json(finished, tmp_path, nproc):
    run = _copy(finished, tmp_path / "run", keep_steps=(2,))
    (_ckpt(run, 2) / "trainer.json").write_text("{not json")
    before = _snapshot(run)
    done = _cli("train", "--out", str(run), "--resume", "--steps", "3", "--nproc", nproc)
    _assert_one_line_exit_2(done, "step_00000002/trainer.json", "no older")
    assert _snapshot(run) == before


@pytest.mark.parametrize("nproc", NPROCS)
def test_corrupt_tensors_found_by_the_ranks(finished, tmp_path, nproc):
    """The small files are fine, so this is found inside the ranks (after torchrun started): the
    rank's error file path, not the launcher's pre-check."""
    run = _copy(finished, tmp_path / "run", keep_steps=(2,))
    _flip_a_tensor_byte(_ckpt(run, 2))
    before = _snapshot(run)
    done = _cli("train", "--out", str(run), "--resume", "--steps", "3", "--nproc", nproc)
    _assert_one_line_exit_2(done, "step_00000002", "do not match hashes.json")
    assert _snapshot(run) == before


def test_corrupt_newest_checkpoint_falls_back_and_is_kept(finished, tmp_path):
    run = _copy(finished, tmp_path / "run")
    (_ckpt(run, 2) / "trainer.json").write_text("{not json")
    corrupt = _snapshot(_ckpt(run, 2))
    done = _cli("train", "--out", str(run), "--resume", "--steps", "3", "--nproc", "2")
    assert done.exit_code == 0, done.stderr
    assert "resuming from step_00000001" in done.stderr and "corrupt-step_00000002" in done.stderr
    assert "step 2/3" in done.stderr and "step 3/3" in done.stderr
    kept = run / "checkpoints" / "corrupt-step_00000002"
    assert _snapshot(kept) == corrupt  # set aside, byte for byte, never deleted
    assert (_ckpt(run, 2) / "trainer.json").read_text() != "{not json"  # step 2 written again
    history = json.loads((run / "manifest.json").read_text())["world_size_history"]
    assert [h["start_step"] for h in history] == [0, 1]
    # step 2, trained again after the fallback, gives the bits it had the first time (no conflicting repeats)
    same = compare_runs(run, finished, steps=(1, 2))
    assert same.identical and same.only_in_a == same.only_in_b == 0 and same.compared > 0, same.first_divergence
    assert compare_runs(run, run).conflicts_a == 0


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc; Linux)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped yet


def _poll(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux")
@pytest.mark.parametrize(
    "command",
    [
        ["train", "--config", "tiny-dense", "--steps", "400", "--set", "checkpoint.interval=0"],
        ["rl", "--config", "rl-tiny", "--steps", "400", "--set", "checkpoint.interval=0"],
    ],
    ids=["train", "rl"],
)
def test_second_writer_is_refused_and_ranks_die_with_the_launcher(tmp_path, command):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "titan_audit.cli", *command, "--nproc", "2", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        lock = out / ".lock"
        _poll(
            lambda: lock.is_file() and lock.read_text().strip() == str(first.pid) and (out / "manifest.json").is_file(),
            120,
            "the first run to start",
        )
        second = _cli(command[0], "--out", str(out), "--resume", "--nproc", "2")
        _assert_one_line_exit_2(second, str(out), f"process {first.pid}", "is writing this run")
        _poll(lambda: len(_children(first.pid)) >= 3, 120, "torchrun and both ranks")  # torchrun + 2 ranks
        descendants = _children(first.pid)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        _poll(
            lambda: not any(_alive(p) for p in descendants), 20, f"torchrun and the ranks {sorted(descendants)} to die"
        )
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # the kernel dropped the lock with its holder: the run can be taken over (negative control)
    again = _cli(command[0], "--out", str(out), "--resume", "--steps", "0")
    assert "is writing this run" not in again.stderr, again.stderr
