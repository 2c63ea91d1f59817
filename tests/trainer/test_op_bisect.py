"""`bisect --step N` on two run directories re-runs step N of each from its latest checkpoint before
N, under DebugMode, and names the first aten op whose outputs differ.

Proves: two runs of the same config give identical op logs for a re-run step (exit 0), the source
runs are only read; negative control: a run trained with another learning rate is reported
(exit 1) at the first op reading a parameter, with inputs that already differ; bad input (a step
without a checkpoint before it, a step past the run) exits 2 before any work.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli
from titan_audit.trainer.config import load_config
from titan_audit.trainer.op_bisect import bisect_step
from titan_audit.trainer.train import train

SMALL = ["steps=3", "checkpoint.interval=2", "data.global_batch_size=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bisect")
    for name, extra in (("a", []), ("again", []), ("other_lr", ["optimizer.lr=0.002"])):
        train(load_config("tiny-dense", [*SMALL, *extra]), root / name, quiet=True)
    return root


def _bisect(*args):
    return CliRunner().invoke(cli, ["bisect", *map(str, args)])


def test_same_config_rerun_step_is_identical_op_for_op(runs):
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    result = _bisect(runs / "a", runs / "again", "--step", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["identical"] and data["ops_a"] == data["ops_b"] > 100
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before  # the runs are only read


def test_negative_control_another_learning_rate_is_named(runs):
    comparison = bisect_step(runs / "a", runs / "other_lr", 3)
    assert not comparison.identical
    data = comparison.to_dict()
    # the checkpoints of step 2 differ, so the first op that reads a parameter differs, and its
    # inputs already differ: the difference came from outside the step
    assert data["kind"] == "output" and data["inputs_identical"] is False, data
    assert data["log_b"] == f"{runs / 'other_lr'} step 3 (re-run from checkpoint step_2)"
    result = _bisect(runs / "a", runs / "other_lr", "--step", "3")
    assert result.exit_code == 1 and "its inputs already differ" in result.output


def test_bad_steps_exit_2_before_any_work(runs):
    early = _bisect(runs / "a", runs / "again", "--step", "1")
    assert early.exit_code == 2 and "no checkpoint before step 1" in early.output
    late = _bisect(runs / "a", runs / "again", "--step", "9")
    assert late.exit_code == 2 and "outside the run's recorded steps 1..3" in late.output
    assert "Traceback" not in early.output + late.output
