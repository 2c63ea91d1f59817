"""`compare A B --steps FIRST:LAST`: a replay (which holds only the steps after its checkpoint)
compares with its source run without the missing early steps counting (issue 17, point 5).

Negative controls: without --steps, and with a range that reaches into the steps before the
checkpoint, the same pair is reported different (exit 1); a run with another seed differs
inside the range."""

import json

import pytest
from click.testing import CliRunner

from titan_audit.audit import compare_runs
from titan_audit.audit.compare import parse_steps
from titan_audit.cli.main import cli

pytestmark = pytest.mark.slow

TRAIN = [
    "train",
    "--config",
    "tiny-dense",
    "--steps",
    "4",
    "--set",
    "checkpoint.interval=2",
    "--set",
    "audit.level=params",
]
STABLE_KEYS = {
    "identical",
    "expected_differences",
    "run_a",
    "run_b",
    "filters",
    "records_a",
    "records_b",
    "compared",
    "differing",
    "only_in_a",
    "only_in_b",
    "conflicts_a",
    "conflicts_b",
    "first_divergence",
    "spread",
    "only_in_a_examples",
    "only_in_b_examples",
    "fingerprint_warnings",
    "fingerprint_note",
    "config_differences",
    "phase_order",
}


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("steps")
    source, replay, other = root / "a", root / "replay", root / "seed1"
    for args in (
        [*TRAIN, "--out", source],
        ["replay", source, "--from-step", "2", "--out", replay],
        [*TRAIN, "--set", "seed=1", "--out", other],
    ):
        done = _run(*args)
        assert done.exit_code == 0, (args, done.output, done.exception)
    return source, replay, other


def test_replay_compares_on_its_own_steps(runs):
    source, replay, _ = runs
    whole = _run("compare", source, replay)
    assert whole.exit_code == 1 and "recorded in A only" in whole.output  # the early steps, without --steps
    for steps in ("3:4", "3:", "3:9"):
        same = _run("compare", source, replay, "--steps", steps)
        assert same.exit_code == 0, (steps, same.output)
        assert "identical" in same.output and "(steps 3.." in same.output
    reaching_back = _run("compare", source, replay, "--steps", "2:4")
    assert reaching_back.exit_code == 1 and "step 2" in reaching_back.output


def test_json_keeps_its_keys_and_reports_the_range(runs):
    source, replay, _ = runs
    done = _run("compare", source, replay, "--steps", "3:", "--json")
    assert done.exit_code == 0
    data = json.loads(done.stdout)
    assert set(data) == STABLE_KEYS
    assert data["filters"] == {"phase": None, "names": None, "steps": [3, None]}
    assert data["identical"] and data["only_in_a"] == data["only_in_b"] == 0 and data["compared"] > 0
    plain = json.loads(_run("compare", source, source, "--json").stdout)
    assert set(plain) == STABLE_KEYS and plain["filters"]["steps"] is None
    library = compare_runs(source, replay, steps=(3, 4))
    assert library.identical and library.compared == data["compared"]


def test_a_different_run_differs_inside_the_range(runs):
    source, _, other = runs
    done = _run("compare", source, other, "--steps", "3:4")
    assert done.exit_code == 1 and "first divergence: step 3" in done.output


@pytest.mark.parametrize(
    "value, message",
    [
        ("4:3", "FIRST 4 is after LAST 3"),
        ("a:4", "'a' is not a step number"),
        ("-1:3", "step -1 is negative"),
        ("1:2:3", "expected FIRST:LAST"),
        (":", "expected FIRST:LAST"),
        ("", "expected FIRST:LAST"),
    ],
)
def test_bad_range_exits_2_naming_the_value(runs, value, message):
    source, replay, _ = runs
    done = _run("compare", source, replay, "--steps", value)
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--steps {value!r}" in lines[0] and message in lines[0], done.stderr
    with pytest.raises(ValueError, match="--steps"):
        parse_steps(value)


def test_parse_steps():
    assert parse_steps("5:8") == (5, 8) and parse_steps("5:") == (5, None) and parse_steps(":8") == (None, 8)
    assert parse_steps("7") == (7, 7) and parse_steps(" 2 : 3 ") == (2, 3)
