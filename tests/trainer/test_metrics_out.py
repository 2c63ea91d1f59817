"""metrics.jsonl and TensorBoard beside metrics.parquet (trainer/metrics_out.py): the same rows,
each step exactly once after a kill and a resume, for train and rl runs; TensorBoard missing is
refused before any work; the logging keys are resume-mutable and no config difference."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

pytest.importorskip("tensorboard", reason="pip install tensorboard (the test extra)")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402

from titan_audit.audit.config_diff import config_changes  # noqa: E402
from titan_audit.cli.main import cli  # noqa: E402
from titan_audit.rl.config import load_rl_config  # noqa: E402
from titan_audit.rl.loop import rl_train  # noqa: E402
from titan_audit.trainer import metrics_out  # noqa: E402
from titan_audit.trainer.config import load_config, resume_differences, to_dict  # noqa: E402
from titan_audit.trainer.train import train  # noqa: E402

# 6 steps, a checkpoint after step 4; the kill comes right after step 6's metrics, before its checkpoint
TRAIN = ["steps=6", "checkpoint.interval=4", "data.synthetic_records=512", "logging.tensorboard=true"]
RL = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "sampling.max_new_tokens=4", "steps=2"]


def parquet_rows(run: Path) -> list[dict]:
    return pq.read_table(run / "metrics.parquet").to_pylist()


def jsonl_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's own reading of RUN/tensorboard: tag -> [(step, value)]."""
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def raw_steps(run: Path, tag: str) -> list[int]:
    """Every event of `tag` in every event file, read without TensorBoard's purge of restarts."""
    steps = []
    for path in sorted((run / "tensorboard").iterdir()):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


def assert_tensorboard_holds(run: Path, rows: list[dict]) -> None:
    """Each numeric metric once per step, its value the row's as float32 (what TensorBoard keeps), bit for bit."""
    tb = scalars(run)
    numeric = [k for k, v in rows[0].items() if k != "step" and isinstance(v, int | float)]
    assert numeric and sorted(tb) == sorted(numeric)
    for key in numeric:
        assert [step for step, _ in tb[key]] == [row["step"] for row in rows], key
        got = np.array([value for _, value in tb[key]], dtype=np.float32)
        want = np.array([row[key] for row in rows], dtype=np.float32)
        assert got.tobytes() == want.tobytes(), key


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A train run with TensorBoard on, SIGKILLed after step 6 (last checkpoint: step 4), a cut
    line appended to its metrics.jsonl, then resumed: steps 5 and 6 run twice. Returns the run and
    the steps its streams held before the resume."""
    out = tmp_path_factory.mktemp("metrics") / "run"
    overrides = [arg for o in TRAIN for arg in ("--set", o)]
    killed = subprocess.run(
        [sys.executable, "-m", "titan_audit.cli", "train", "--config", "tiny-dense", *overrides, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "TITAN_AUDIT_CRASH_AT": "train.after_step:6"},
        timeout=600,
    )
    assert killed.returncode != 0 and not (out / "checkpoints" / "step_00000006").exists(), killed.stderr[-2000:]
    before = {"jsonl": [row["step"] for row in jsonl_rows(out)], "tensorboard": raw_steps(out, "loss")}
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # a line a kill cut short
    train(load_config("tiny-dense", TRAIN), out, resume=True, quiet=True)
    return out, before


def test_jsonl_rows_are_the_parquet_rows_each_step_once_after_a_kill(resumed):
    run, before = resumed
    assert before["jsonl"] == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 were written before the kill, and run again
    rows = parquet_rows(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert jsonl_rows(run) == rows  # same keys, same values (floats round-trip exactly)
    assert (run / "metrics.jsonl").read_text().endswith("}\n")  # the cut line is gone


def test_tensorboard_holds_the_scalars_each_step_once_after_a_kill(resumed):
    run, before = resumed
    assert before["tensorboard"] == [1, 2, 3, 4, 5, 6]
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per start, append only
    # control: the event files hold steps 1..6 twice; TensorBoard's reader keeps the restart's copy
    assert sorted(raw_steps(run, "loss")) == sorted([1, 2, 3, 4, 5, 6] * 2)
    assert_tensorboard_holds(run, parquet_rows(run))


def test_rl_run_writes_both_streams(tmp_path):
    run = tmp_path / "rl"
    rl_train(load_rl_config("rl-tiny", [*RL, "logging.tensorboard=true"]), run, quiet=True)
    rows = parquet_rows(run)
    assert [row["step"] for row in rows] == [1, 2]
    assert jsonl_rows(run) == rows
    assert_tensorboard_holds(run, rows)


def test_tensorboard_off_writes_no_event_files(tmp_path):
    """The default: metrics.jsonl only; a resume that turns TensorBoard on gets the kept history."""
    run = tmp_path / "plain"
    plain = [o for o in TRAIN if not o.startswith("logging.")] + ["steps=2", "checkpoint.interval=1"]
    train(load_config("tiny-dense", plain), run, quiet=True)
    assert not (run / "tensorboard").exists() and [r["step"] for r in jsonl_rows(run)] == [1, 2]
    train(load_config("tiny-dense", [*plain, "steps=3", "logging.tensorboard=true"]), run, resume=True, quiet=True)
    assert jsonl_rows(run) == parquet_rows(run)
    assert_tensorboard_holds(run, parquet_rows(run))


def test_missing_tensorboard_is_one_line_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        metrics_out.importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    out = tmp_path / "run"
    args = ["train", "--config", "tiny-dense", "--set", "logging.tensorboard=true", "--out", str(out)]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "logging.tensorboard" in lines[0] and "pip install tensorboard" in lines[0], lines
    assert not out.exists()
    metrics_out.check_logging(load_config("tiny-dense"))  # control: TensorBoard off needs no package


def test_logging_keys_are_resume_mutable_and_no_config_difference():
    base = load_config("tiny-dense")
    changed = load_config("tiny-dense", ["logging.tensorboard=true", "logging.jsonl=false"])
    saved = to_dict(base)
    assert resume_differences(saved, changed) == []
    assert config_changes(saved, to_dict(changed)) == []
    old = {k: v for k, v in saved.items() if k != "logging"}  # a run (or golden) from before the section
    assert resume_differences(old, changed) == [] and config_changes(old, to_dict(changed)) == []
    # control: a key that changes the bits is a difference for both
    other = load_config("tiny-dense", ["logging.tensorboard=true", "seed=1"])
    assert resume_differences(saved, other) == ["seed: 0 -> 1"]
    assert [c[0] for c in config_changes(saved, to_dict(other))] == ["seed"]
