"""The demo (the README's main job): `titan-audit demo --quick` end to end proves every guarantee
and writes the report, which renders in headless Chromium; a failing guarantee exits 1; its
checks can fail (negative controls whose difference the demo constructs: the generator sent
weights one ulp off, the KV-cache decode in the other gemm order, another seed). The job
(titan_audit.demo.run) reports to a Listener and returns a Result; the terminal view (rich) is
titan_audit.cli.demo_view."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from titan_audit import demo
from titan_audit.cli.main import cli
from titan_audit.demo import driver, verdicts
from titan_audit.demo.stages import batch_invariance, elastic, goldens, kill_resume, train, zero_gap

STAGE_MODULES = {
    "train_w2": train,
    "train_w1": train,
    "kill_resume": kill_resume,
    "spot_checks": batch_invariance,
    "goldens": goldens,
    "zero_gap": zero_gap,
    "zero_gap_vllm": zero_gap,
    "elastic": elastic,
    "control_w2": elastic,
}


@pytest.mark.control
@pytest.mark.parametrize("order, other", [("v2", "v1"), ("v1", "v2")])
def test_decode_check_holds_with_bi_ops_and_fails_in_another_gemm_order(order, other):
    """The G2 control row: the decode summed in the other gemm order differs from the full forward
    (a difference the check constructs, so it shows on any CPU)."""
    from titan_audit import batch_invariant

    with batch_invariant.gemm_order(order):
        assert demo.decode_matches_full_forward(bi=True)
        assert not demo.decode_matches_full_forward(bi=True, decode_gemm_order=other)  # negative control


def test_spot_checks_include_head_dim_128_and_report_native_ops():
    checks = demo.run_spot_checks((128,))
    assert all(c.passed for c in checks), checks
    assert any("D=128" in c.shape for c in checks)
    # native ops are reported, never asserted: whether they differ depends on the CPU's libraries
    assert all(c.native in ("identical", "differs") for c in checks)


def test_demo_refuses_an_existing_out_dir(tmp_path):
    (tmp_path / "keep").write_text("x")
    result = CliRunner().invoke(cli, ["demo", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "already exists" in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


def test_a_failing_guarantee_makes_the_demo_exit_1(tmp_path, monkeypatch):
    """Every stage replaced: one reports a failure; the verdict table shows it, exit code 1, and
    demo.json and the report are still written."""

    def passing(demo):
        demo.row("G1 run to run", "stub", True)

    def failing(demo):
        demo.row("G3 elastic", "stub", False, "2 records differ")

    for name in (
        "train_w2",
        "train_w1",
        "kill_resume",
        "spot_checks",
        "goldens",
        "zero_gap",
        "zero_gap_vllm",
        "control_w2",
    ):
        monkeypatch.setattr(STAGE_MODULES[name], name, passing)
    monkeypatch.setattr(elastic, "elastic", failing)
    result = CliRunner().invoke(cli, ["demo", "--quick", "--out", str(tmp_path / "d")])
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "demo FAILED" in result.output
    summary = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert summary["passed"] is False and [r["result"] for r in summary["rows"]].count("FAIL") == 1
    assert (tmp_path / "d" / "reports" / "report.html").is_file()


class Recorder(demo.Listener):
    def __init__(self):
        self.events = []

    def on_start(self, out, quick, numerics, steps):
        self.events.append(("start", quick, steps))

    def on_stage(self, name, title, background=False):
        self.events.append(("stage", name, background))

    def on_status(self, text):
        self.events.append(("status", text))

    def on_done(self, name, seconds):
        self.events.append(("done", name))

    def on_row(self, row):
        self.events.append(("row", row.guarantee, row.result))

    def on_message(self, text):
        self.events.append(("message", text))

    def on_output(self, stage, line):
        self.events.append(("output", stage, line))


def test_a_stage_that_raises_is_a_fail_row_not_a_crash(tmp_path, monkeypatch):
    """The job (no CLI, no terminal) returns the verdicts and tells its listener what happens."""

    def boom(demo):
        raise RuntimeError("torchrun exited 1")

    for name in (
        "train_w1",
        "kill_resume",
        "spot_checks",
        "goldens",
        "zero_gap",
        "zero_gap_vllm",
        "elastic",
        "control_w2",
    ):
        monkeypatch.setattr(STAGE_MODULES[name], name, lambda demo: None)
    monkeypatch.setattr(train, "train_w2", boom)
    recorder = Recorder()
    result = demo.run(tmp_path / "d", quick=True, listener=recorder)
    assert result.passed is False and not result and result.quick and result.out == tmp_path / "d"
    assert result.report is not None and result.report["html"].endswith("report.html")
    assert [s["name"] for s in result.stages][-1] == "elastic" and len(result.stages) == 8  # --quick: no control
    rows = json.loads((tmp_path / "d" / "demo.json").read_text())["rows"]
    assert rows == [r.__dict__ for r in result.rows]
    events = recorder.events
    assert events[0] == ("start", True, 9) and events[-1] == ("done", "report")
    assert ("stage", "train_w2", True) in events and ("row", "G3", "FAIL") in events
    assert [e[1] for e in events if e[0] == "done"].count("train_w2") == 1
    assert sum(e[0] == "done" for e in events) == 9
    assert ("status", "writing the report") in events
    assert not [e for e in events if e[0] in ("message", "output")]  # not verbose: no traceback, no output
    assert rows == [
        {
            "guarantee": "G3",
            "checked": "stage train_w2",
            "result": "FAIL",
            "detail": "RuntimeError: torchrun exited 1",
            "evidence": str(tmp_path / "d" / "logs" / "train-w2.log"),
        }
    ]


def _summary(differing: int) -> dict:
    return {
        "steps": 2,
        "verified": True,
        "zero_gap": differing == 0,
        "tokens_compared": 64,
        "tokens_differing": differing,
        "steps_with_gap": int(differing > 0) * 2,
        "max_abs_diff": 0.5 * differing,
    }


@pytest.mark.parametrize("quick", [True, False])
def test_the_zero_gap_stage_is_verify_onpolicy_with_its_runs_side_by_side(tmp_path, monkeypatch, quick):
    """The G4 stage calls the library function behind `verify-onpolicy` (no RL loop of its own):
    the control (and, without --quick, the native-ops run) go to OUT/rl-control and OUT/rl-native;
    the rows are the verdicts of what it returns. Negative control: a control without a gap FAILs."""
    from titan_audit.demo.runner import Demo
    from titan_audit.rl import verify

    calls = []

    def fake(source, out, **options):
        calls.append((source, out, options))
        control = {**_summary(control_differing), "control": "generator-weight-ulp"}
        native = _summary(3) if options["compare_default"] else None
        return verify.Verification(
            0, passed=True, report={"summary": _summary(0), "control": control, "default": native}
        )

    monkeypatch.setattr(verify, "verify_onpolicy", fake)
    for control_differing, control_result in ((5, "PASS"), (0, "FAIL")):
        out = tmp_path / f"{quick}-{control_differing}"
        run = Demo(out, demo.Plan.make(quick), verbose=False)
        zero_gap.zero_gap(run)
        source, where, options = calls[-1]
        assert source == "rl-tiny" and where == out / "rl-builtin" and options["control"]
        assert options["control_out"] == out / "rl-control"
        assert options["default_out"] == (None if quick else out / "rl-native")
        assert options["compare_default"] is not quick and options["steps"] == run.plan.rl_steps
        rows = {r.guarantee: r for r in run.rows}
        assert rows["G4 zero gap"].result == "PASS" and "64 sampled tokens, 0 with" in rows["G4 zero gap"].detail
        assert rows["G4 control"].result == control_result
        assert ("native ops (reported, not counted): 3 of 64" in rows["G4 control"].detail) is not quick
        assert [p["b"] for p in run.extra["divergence"]] == ["rl-control"] + ([] if quick else ["rl-native"])


def test_a_failed_launch_in_the_zero_gap_stage_names_the_run(tmp_path, monkeypatch):
    from titan_audit.demo.runner import Demo
    from titan_audit.rl import verify

    monkeypatch.setattr(verify, "verify_onpolicy", lambda *a, **k: verify.Verification(3, tmp_path / "rl-control"))
    with pytest.raises(RuntimeError, match=r"rl-control exited 3"):
        zero_gap.zero_gap(Demo(tmp_path, demo.Plan.make(True), verbose=False))


def test_verify_onpolicy_exit_code():
    """What `titan-audit verify-onpolicy` exits with: a failed launch's code, else 0 iff passed, else 1."""
    from titan_audit.rl.verify import Verification

    assert Verification(0, passed=True).exit_code == 0
    assert Verification(0, passed=False).exit_code == 1
    assert Verification(2).exit_code == 2 and Verification(-9).exit_code == -9


def test_vllm_status_is_what_available_returns_here():
    from titan_audit.rl import vllm as rl_vllm

    installed = rl_vllm.available()
    assert isinstance(installed, bool)  # the one form vllm_status reads
    assert demo.vllm_status()[0] is installed


@pytest.mark.parametrize("installed", [True, False])
def test_vllm_status_follows_available_and_says_how_to_install(monkeypatch, installed):
    from titan_audit.rl import vllm as rl_vllm

    monkeypatch.setattr(rl_vllm, "available", lambda: installed)
    ok, reason = demo.vllm_status()
    assert ok is installed
    if installed:
        assert reason == ""
    else:
        assert reason.startswith("skipped: ") and rl_vllm.INSTALL_HINT in reason


def test_verdict_table_prints_bracketed_text_as_it_is(tmp_path):
    """Row text is not rich markup: the install hint's `.[vllm]` survives (it once vanished)."""
    from rich.console import Console

    from titan_audit.cli.demo_view import verdict_table

    console = Console(record=True, width=240)
    rows = [verdicts.Row("G4 zero gap", "vLLM [generator]", "SKIP", "pip install -e '.[vllm]'", "[x]/y")]
    console.print(verdict_table(rows, tmp_path))
    text = console.export_text()
    assert ".[vllm]" in text and "vLLM [generator]" in text and "[x]/y" in text


def test_demo_view_prints_rows_messages_and_output_as_they_are(tmp_path):
    from rich.console import Console

    from titan_audit.cli.demo_view import DemoView

    console = Console(record=True, width=240)
    with DemoView(console) as view:
        view.on_start(tmp_path, True, "numerics: [n]", 2)
        view.on_stage("s", "G4: stage [t]")
        view.on_row(verdicts.Row("G4 zero gap", "vLLM [generator]", "SKIP", "pip install -e '.[vllm]'"))
        view.on_message("  trained [m] -> x")
        view.on_output("rl-vllm", "INFO [engine] started")
        view.on_done("s", 0.1)
    lines = console.export_text().splitlines()
    assert "titan-audit demo --quick" in lines[0] and lines[1] == f"numerics: [n]; runs go to {tmp_path}"
    for line in (
        "G4: stage [t]",
        "  SKIP G4 zero gap: vLLM [generator] (pip install -e '.[vllm]')",
        "  trained [m] -> x",
        "rl-vllm> INFO [engine] started",
    ):
        assert line in lines, lines


def test_the_demo_job_imports_no_rich():
    """Terminal presentation lives in titan_audit/cli/: no module of demo/ imports rich, at the top or in a function."""
    trees = [ast.parse(p.read_text()) for p in sorted(Path(driver.__file__).parent.rglob("*.py"))]
    nodes = [n for tree in trees for n in ast.walk(tree)]
    names = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in nodes if isinstance(n, ast.ImportFrom)]
    assert len(trees) > 5 and "titan_audit.log" in names  # every module of the package read; it logs instead
    assert not [m for m in names if m.split(".")[0] == "rich"], names


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "quick"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_audit.cli", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out, proc


@pytest.mark.slow
def test_demo_quick_exits_0_and_every_guarantee_is_checked(quick_demo):
    out, proc = quick_demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo passed: every guarantee held" in proc.stdout
    summary = json.loads((out / "demo.json").read_text())
    assert summary["passed"] and summary["quick"]
    results = {}
    for row in summary["rows"]:
        results.setdefault(row["guarantee"].split()[0], []).append(row["result"])
    for g in ("G1", "G2", "G3", "G4", "G5"):
        assert "PASS" in results[g] and "FAIL" not in results[g], (g, summary["rows"])
    vllm = [r for r in summary["rows"] if "vLLM" in r["checked"]]
    assert len(vllm) == 1 and vllm[0]["result"] == "SKIP" and vllm[0]["detail"].startswith("skipped in --quick")
    controls = [r for r in summary["rows"] if r["guarantee"].endswith("control")]
    assert {r["guarantee"] for r in controls} >= {"G1 control", "G2 control", "G4 control"} and all(
        r["result"] == "PASS" for r in controls
    )
    (g4,) = [r for r in controls if r["guarantee"] == "G4 control"]  # the constructed control, not native ops
    assert "one ulp" in g4["checked"] and " tokens differ, on " in g4["detail"] and "native" not in g4["detail"]
    assert summary["runs"]["rl_control"] == "rl-control" and "rl_native" not in summary["runs"]  # --quick: 2 RL runs
    assert any("D=128" in s["shape"] for s in summary["spot_checks"])
    assert summary["kill"]["returncode"] == -9
    md = (out / "reports" / "report.md").read_text()
    assert "## Verdicts" in md and "## Zero gap (G4)" in md and "Divergence map" in md


@pytest.mark.slow
def test_demo_report_renders_in_headless_chromium(quick_demo):
    from headless_chromium import Chromium

    out, proc = quick_demo
    assert proc.returncode == 0, proc.stdout[-3000:]
    with Chromium() as browser:
        page = browser.load(out / "reports" / "report.html")
    assert page.errors == [], page.errors
    assert len(page.images) >= 4 and all(i["naturalWidth"] > 0 for i in page.images), page.images
    assert "every guarantee held" in page.text
