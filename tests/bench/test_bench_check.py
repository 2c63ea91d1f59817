"""`bench --check`: exit 1 when a case misses its target (the JSON names it), 0 when every target
is met, 2 when the suite has no target; the progress bar shows on stderr only when asked for.

The suite is a stand-in registered under `hash` (two trivial cases timed by bench.core.compare,
through run_suite and the real command), so the targets are chosen, not measured luck."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from titan_audit.bench import SUITES, compare
from titan_audit.cli.main import cli
from titan_audit.progress import PROGRESS_ENV


def stand_in(targets: dict[str, float | None]):
    def suite(options, progress):
        cases = []
        for name, target in targets.items():
            cases.append(compare(name, ("noop", lambda: None), ("noop too", lambda: None), options, target=target))
            progress(name)
        return cases

    return suite


def bench(monkeypatch, targets, *args):
    monkeypatch.setitem(SUITES, "hash", stand_in(targets))
    return CliRunner().invoke(cli, ["bench", "hash", "--repeats", "1", *args])


MET, MISSED = 1e9, 1e-12  # ratio <= target: any ratio meets 1e9, none meets 1e-12


def test_check_exits_1_naming_the_missed_case(monkeypatch):
    done = bench(monkeypatch, {"fast": MET, "slow": MISSED, "untargeted": None}, "--check", "--json")
    assert done.exit_code == 1, done.output
    summary = json.loads(done.stdout)["summary"]
    assert summary["missed"] == ["slow"] and summary["targets_missed"] == 1 and summary["targets"] == 2
    table = bench(monkeypatch, {"fast": MET, "slow": MISSED}, "--check")
    assert table.exit_code == 1 and "MISSED" in table.stdout and "targets missed 1 of 2: slow" in table.stdout


def test_check_exits_0_when_every_target_is_met(monkeypatch):
    done = bench(monkeypatch, {"fast": MET, "untargeted": None}, "--check", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["summary"]["missed"] == []
    # control: without --check a missed target is reported, not an exit code
    assert bench(monkeypatch, {"slow": MISSED}, "--json").exit_code == 0


def test_check_of_a_suite_without_targets_is_bad_input(monkeypatch):
    done = bench(monkeypatch, {"untargeted": None}, "--check", "--json")
    assert done.exit_code == 2
    assert (
        done.stderr.strip().splitlines()[-1] == "Error: bench hash: no case has a target; --check has nothing to check"
    )


@pytest.mark.parametrize(("forced", "shown"), [("1", True), ("0", False)])
def test_progress_bar_on_stderr_only_when_enabled(monkeypatch, forced, shown):
    monkeypatch.setenv(PROGRESS_ENV, forced)
    done = bench(monkeypatch, {"first-case": MET, "last-case": MET}, "--json")
    assert done.exit_code == 0
    json.loads(done.stdout)  # stdout stays one JSON object
    assert ("bench hash" in done.stderr) is shown, done.stderr
