"""`train --until` (trainer/until.py): a run that stops at a skill level evaluated on held-out
prompts. The evaluation has the same bits at W=1 and W=2 (so both stop at the same step with the
same audit hashes), a resume adopts the recorded condition and makes the same decision, a run that
stopped cannot be resumed, another condition on a resume is refused, bad specs name `--until`.

Negative controls: a condition that never holds runs to the step count; the held-out prompts of
another seed (and the RL run's own prompts) differ, and the values at two evaluation steps differ,
so the equalities below compare something that moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from command_line import cli

from titan_audit.audit import compare_runs
from titan_audit.rl.skill import held_out_prompts
from titan_audit.rl.tasks import prompt_set
from titan_audit.trainer.config import load_config
from titan_audit.trainer.train import train
from titan_audit.trainer.until import parse_until

EVAL = "every=2,prompts=16,samples=4,max_new_tokens=6"
SETTINGS = ["steps=6", "checkpoint.interval=2", "determinism.batch_invariant=true"]


def rows(run: Path) -> list[dict]:
    return sorted(pq.read_table(run / "metrics.parquet").to_pylist(), key=lambda r: r["step"])


def config(*extra: str):
    return load_config("tiny-dense", [*SETTINGS, *extra])


@pytest.fixture(scope="module")
def never(tmp_path_factory) -> Path:
    """The values at steps 2, 4, 6 under a condition that never holds (the negative control)."""
    out = tmp_path_factory.mktemp("until") / "never"
    train(config(), out, quiet=True, until=f"reward<=-1,{EVAL}")
    return out


def stopping_at_four(never: Path) -> str:
    """A condition false at step 2 and true at step 4, from the never-stopping run's values."""
    values = {r["step"]: r["until_value"] for r in rows(never) if r["until_value"] is not None}
    v2, v4 = values[2], values[4]
    assert v2 != v4, values  # the weights moved the metric (else the test would compare constants)
    return f"reward>={v4!r},{EVAL}" if v4 > v2 else f"reward<={v4!r},{EVAL}"


def test_a_condition_that_never_holds_runs_to_the_step_count(never):
    got = rows(never)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["until_value"] is not None for r in got] == [False, True, False, True, False, True]
    assert not any(r["until_stop"] for r in got)
    assert json.loads((never / "manifest.json").read_text())["until"]["every"] == 2


def test_world_sizes_one_and_two_stop_at_the_same_step_with_the_same_bits(never, tmp_path):
    until = stopping_at_four(never)
    one, two = tmp_path / "w1", tmp_path / "w2"
    train(config(), one, quiet=True, until=until)
    args = ["--set", *[a for s in SETTINGS for a in (s, "--set")]][:-1]
    proc = cli("train", "--config", "tiny-dense", "--out", str(two), "--nproc", "2", *args, "--until", until)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in (one, two):
        got = rows(run)
        assert [r["step"] for r in got] == [1, 2, 3, 4] and [r["until_stop"] for r in got] == [False] * 3 + [True]
        assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000004"
    a, b, ref = rows(one), rows(two), rows(never)[:4]
    assert [r["until_value"] for r in a] == [r["until_value"] for r in b] == [r["until_value"] for r in ref]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    result = compare_runs(one, two)
    assert result.identical and result.compared > 0, result.first_divergence
    # a stopped run is not resumed; another condition on a resume is refused
    with pytest.raises(ValueError, match=r"stopped at step 4 by --until reward.* nothing to run"):
        train(config(), one, resume=True, quiet=True)
    with pytest.raises(ValueError, match=r"started with --until reward.*; this resume gives accuracy>=0\.5"):
        train(config(), one, resume=True, quiet=True, until=f"accuracy>=0.5,{EVAL}")


def test_a_resume_adopts_the_recorded_condition_and_makes_the_same_decision(never, tmp_path):
    until = stopping_at_four(never)
    out = tmp_path / "resumed"
    train(config(), out, quiet=True, until=until, stop_at=3)  # interrupted after step 3 (checkpoint 2 and 3)
    train(config(), out, resume=True, quiet=True)  # no --until given: the recorded one
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got[-1]["until_stop"]
    assert [r["until_value"] for r in got] == [r["until_value"] for r in rows(never)[:4]]


def test_held_out_prompts_are_keyed_by_seed_and_apart_from_the_rl_prompts():
    until = parse_until("reward>=0.2,prompts=8")
    zero = held_out_prompts(until, 0)
    assert [p.text for p in zero] == [p.text for p in held_out_prompts(until, 0)]
    assert [p.text for p in zero] != [p.text for p in held_out_prompts(until, 1)]
    assert [p.text for p in zero] != [p.text for p in prompt_set("reversal-short", 0, 0, 8)]
    assert all(p.task == "reversal-short" for p in zero)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("loss<=1", r"unknown metric 'loss'"),
        ("reward>0.2", r"expected METRIC>=VALUE"),
        ("reward>=0.2,every=0", r"every=0: must be >= 1"),
        ("reward>=0.2,task=poetry", r"task='poetry': not a built-in task"),
        ("reward>=0.2,speed=3", r"'speed=3' is not key=value with a key of task, every"),
        ("reward>=0.2,prompts=many", r"prompts='many': not a int"),
        ("reward>=0.2,evaluator=no_such_module", r"evaluator='no_such_module': cannot import it"),
    ],
)
def test_a_bad_spec_names_until(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_until(spec)


def test_a_bad_spec_on_the_command_line_is_one_line_and_exit_two(tmp_path):
    from command_line import cli_here, one_line_error

    out = tmp_path / "bad"
    proc = cli_here("train", "--config", "tiny-dense", "--out", str(out), "--until", "reward>=x")
    one_line_error(proc, r"--until 'reward>=x': expected METRIC>=VALUE")
    assert not out.exists()
