"""Issue 23, item 2: a fault of the machine is one line naming the path and the errno, exit 2; the
traceback goes to a log file (the run's logs/, or the system temp dir when the run cannot be
written), which the line names; -v shows the traceback instead.

The faults are injected at the write calls (tests/fault_injection.py): CI runs as root, which
ignores permission bits. A full disk during a checkpoint is injected at the checkpoint's own
crash point (`TITAN_AUDIT_CRASH_AT=checkpoint.before_rename:N:0:ENOSPC`), in this process and in a
torchrun rank. Negative controls: the same commands without the fault succeed, and a resume after
the failed save continues the run.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from fault_injection import failing_writes, one_line_error, snapshot

from titan_audit.cli.main import cli
from titan_audit.log import VERBOSE_ENV
from titan_audit.trainer.crash import CRASH_ENV

QUICK = ["--config", "tiny-dense", "--set", "parallel.threads=1", "--set", "checkpoint.interval=2"]


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run."""
    run = tmp_path_factory.mktemp("finished") / "run"
    done = _cli("train", *QUICK, "--steps", "2", "--out", run)
    assert done.exit_code == 0, done.output
    return run


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The system temp dir, for this test only (where tracebacks go when the run cannot be written)."""
    directory = tmp_path / "systemp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def _saved_traceback(line: str) -> Path:
    assert "(traceback in " in line and "; -v prints it)" in line, line
    path = Path(line.split("(traceback in ", 1)[1].split(";", 1)[0])
    assert path.is_file() and "Traceback (most recent call last)" in path.read_text(), path
    return path


def _commands(finished: Path, read_only: Path, corpus: Path):
    copy = read_only / "run"
    shutil.copytree(finished, copy)
    return {
        "train a new run": ["train", *QUICK, "--steps", "1", "--out", read_only / "new"],
        "train --resume": ["train", "--resume", "--out", copy, "--steps", "3"],
        "rl a new run": [
            "rl",
            "--config",
            "rl-tiny",
            "--steps",
            "1",
            "--set",
            "parallel.threads=1",
            "--out",
            read_only / "rl",
        ],
        "data prepare": ["data", "prepare", corpus, "--out", read_only / "store.zarr"],
        "data synth": ["data", "synth", read_only / "synth", "--num", "8"],
        "golden record": ["golden", "record", finished, read_only / "golden"],
        "report": ["report", copy],
    }


CASES = ["train a new run", "train --resume", "rl a new run", "data prepare", "data synth", "golden record", "report"]


@pytest.mark.parametrize("case", CASES)
def test_a_read_only_directory_is_one_line(case, finished, tmp_path, temp_dir, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n' * 4)
    args = _commands(finished, read_only, corpus)[case]
    before = snapshot(read_only)
    failing_writes(monkeypatch, read_only, errno.EACCES)
    line = one_line_error(_cli(*args), "permission denied (EACCES)", str(read_only))
    assert _saved_traceback(line).parent == temp_dir  # the run itself cannot be written
    monkeypatch.undo()
    assert snapshot(read_only) == before


def test_verbose_shows_the_traceback_instead(finished, tmp_path, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "0")  # -v exports "1": the test's undo removes it again
    read_only = tmp_path / "ro"
    read_only.mkdir()
    failing_writes(monkeypatch, read_only, errno.EROFS)
    done = _cli("-v", "train", *QUICK, "--steps", "1", "--out", read_only / "new")
    assert isinstance(done.exception, OSError) and done.exception.errno == errno.EROFS


def test_the_commands_work_without_the_fault(finished, tmp_path):
    """The negative control: each command above succeeds on a writable directory."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n' * 4)
    for case, args in _commands(finished, tmp_path, corpus).items():
        if case.startswith("rl"):
            continue  # an RL step costs seconds; the read-only case above stops before any
        done = _cli(*args)
        assert done.exit_code == 0, (case, done.output)


def test_a_full_disk_during_a_checkpoint_save(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv(CRASH_ENV, "checkpoint.before_rename:2:0:ENOSPC")
    line = one_line_error(_cli("train", *QUICK, "--steps", "4", "--out", run), "no space left on device (ENOSPC)")
    assert _saved_traceback(line).parent == run / "logs"  # the run is writable: its own logs/
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []  # the partial was removed
    monkeypatch.delenv(CRASH_ENV)
    done = _cli("train", "--resume", "--out", run)  # no checkpoint was written: it starts from step 0
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


@pytest.mark.slow
def test_a_full_disk_in_a_torchrun_rank_is_one_line(tmp_path, monkeypatch):
    """The same fault in rank 0 of a --nproc 2 launch (the resume after it: the test above)."""
    run = tmp_path / "run"
    monkeypatch.setenv(CRASH_ENV, "checkpoint.before_rename:2:0:ENOSPC")
    done = _cli("train", *QUICK, "--steps", "2", "--nproc", "2", "--out", run)
    line = one_line_error(done, "no space left on device (ENOSPC)", "step_00000002")
    assert "ChildFailedError" not in done.stderr
    assert _saved_traceback(line).parent == run / "logs"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []


def test_corrupt_checkpoints_are_one_line(tmp_path):
    """DCP's errors carry every failed rank's traceback in their text; each message here is one line."""
    run = tmp_path / "run"
    assert _cli("train", *QUICK, "--steps", "4", "--out", run).exit_code == 0

    def corrupt(step: int) -> None:
        for distcp in (run / "checkpoints" / f"step_{step:08d}").rglob("*.distcp"):
            distcp.write_bytes(distcp.read_bytes()[:100])

    corrupt(4)
    refused = _cli("train", "--resume", "--out", run, "--steps", "5", "--set", "checkpoint.fallback=false")
    one_line_error(refused, "step_00000004: cannot read model/optimizer tensors (rank 0: EOFError)", "step_00000002")
    fell_back = _cli("train", "--resume", "--out", run, "--steps", "5")  # the control: the older one loads
    assert fell_back.exit_code == 0, fell_back.output
    warnings = [line for line in fell_back.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "resuming from step_00000002" in warnings[0], fell_back.stderr
    assert "Traceback" not in fell_back.stderr
    for step in (2, 4, 5):  # the resumed run wrote step_4 and step_5 anew
        corrupt(step)
    for fallback in ("true", "false"):
        done = _cli("train", "--resume", "--out", run, "--steps", "6", "--set", f"checkpoint.fallback={fallback}")
        one_line_error(done, "step_00000005: cannot read model/optimizer tensors (rank 0: EOFError)")
