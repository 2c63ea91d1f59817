"""Benchmark results as data: `bench --save` writes a complete file and never replaces one; the
performance tables of README.md and docs/performance.md are what benchmarks/results/ gives, and a
changed or newer results file changes them (the control). The saving command runs a stand-in suite
registered under `hash` (trivial cases timed by bench.core.compare), so the test takes seconds."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from titan_audit.bench import SUITES, compare
from titan_audit.bench.results import (
    RESULTS_DIR,
    generated_pages,
    load_results,
    machine_kind,
    newest,
    replace_between_markers,
    save_result,
)
from titan_audit.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 12, 6, 1, 2, 3, tzinfo=dt.UTC)


def stand_in(options, progress):
    return [compare("noop", ("a", lambda: None), ("b", lambda: None), options, target=1e9)]


def test_save_writes_suite_kind_date_commit_and_never_replaces(monkeypatch, tmp_path):
    monkeypatch.setitem(SUITES, "hash", stand_in)
    run = CliRunner().invoke(
        cli, ["bench", "hash", "--repeats", "1", "--json", "--save", "--results-dir", str(tmp_path), "--notes", "n"]
    )
    assert run.exit_code == 0, run.output
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    printed = json.loads(run.stdout)
    assert data["cases"] == printed["cases"] and data["machine"] == printed["machine"]  # what --json prints
    saved = data["saved"]
    assert path.name == f"hash-{saved['kind']}-{saved['time'][:10]}-{saved['commit']}.json"
    assert {"cpu_vendor", "cpu_model", "cpu_isa", "commit", "dirty", "options", "gpu"} <= saved.keys()
    assert saved["notes"] == "n" and saved["options"]["repeats"] == 1
    first = path.read_bytes()
    direct = tmp_path / "direct"
    again = save_result(printed, direct, options={}, now=NOW, commit=("0123abcd", False))
    third = save_result(printed, direct, options={}, now=NOW, commit=("0123abcd", False))
    assert again.name == f"hash-{saved['kind']}-2026-12-06-0123abcd.json" and third.name == again.stem + "-2.json"
    assert json.loads(again.read_text())["saved"]["time"] == "2026-12-06T01:02:03Z"
    assert path.read_bytes() == first and json.loads(again.read_text()) == json.loads(third.read_text())
    assert not list(tmp_path.rglob(".*"))  # no temporary left behind


def test_machine_kinds():
    assert machine_kind({"cpu_vendor": "GenuineIntel", "cpu_isa": "avx512", "gpu": None}) == "intel-avx512"
    assert machine_kind({"cpu_vendor": "AuthenticAMD", "cpu_isa": "avx2", "gpu": None}) == "amd-avx2"
    assert machine_kind({"cpu_vendor": "AuthenticAMD", "cpu_isa": "avx512", "gpu": "NVIDIA H100 80GB HBM3"}) == (
        "gpu-nvidia-h100-80gb-hbm3"
    )


def test_the_committed_tables_are_what_the_results_give():
    """README.md and docs/performance.md hold exactly the tables scripts/perf_tables.py makes."""
    assert list((ROOT / RESULTS_DIR).glob("*.json")), "benchmarks/results/ holds no saved result"
    for page, text in generated_pages(ROOT).items():
        assert page.read_text() == text, f"{page.name} is stale: run scripts/perf_tables.py"


def _newest_file(results_dir: Path, suite: str) -> Path:
    current = newest(load_results(results_dir))
    kind = sorted(k for k, s in current if s == suite)[0]
    return results_dir / current[(kind, suite)]["file"]


@pytest.mark.control
def test_control_a_changed_or_newer_results_file_changes_the_tables(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / RESULTS_DIR, results)
    before = generated_pages(ROOT, results)
    path = _newest_file(results, "train")
    data = json.loads(path.read_text())
    data["cases"][1]["ratio"] = 12.345
    path.write_text(json.dumps(data))
    changed = generated_pages(ROOT, results)
    for page in before:
        assert changed[page] != before[page] and "12.345x" in changed[page], page.name
    data["cases"][1]["ratio"] = 0.5
    data["saved"]["time"] = "2999-01-01T00:00:00Z"  # a newer file of the same kind wins the row
    kind = data["saved"]["kind"]
    (results / f"train-{kind}-2999-01-01-0123abcd.json").write_text(json.dumps(data))
    newer = generated_pages(ROOT, results)
    assert all("0.500x" in text and "12.345x" not in text for text in newer.values())


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(ValueError, match="notes.json: not a saved bench result name"):
        load_results(tmp_path)
    with pytest.raises(ValueError, match="perf:x:begin"):
        replace_between_markers("no markers here", "x", "body\n")
    assert replace_between_markers("a<!-- perf:x:begin -->old<!-- perf:x:end -->b", "x", "new\n") == (
        "a<!-- perf:x:begin -->\nnew\n<!-- perf:x:end -->b"
    )
