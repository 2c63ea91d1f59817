"""`titan-audit golden kernels`: exit codes, messages, --json, --record, --mark-passed.

Proves: 0 when every hash is reproduced; 1 when one differs (the case is named); 2 with one line
naming the file for a missing, corrupt or foreign golden, an existing golden without --force, a
missing or stale battery build; --record refuses to overwrite, writes a golden that then passes
and keeps the other section when recording one; --mark-passed appends this CPU after a passing
check and does not repeat it; --json prints one object with stable keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from titan_audit.batch_invariant.cpu import _lib
from titan_audit.cli.main import cli
from titan_audit.portability import battery, kernel_golden

GOLDEN = kernel_golden.DEFAULT_PATH


def _run(*args: str):  # noqa: ANN202
    return CliRunner().invoke(cli, ["golden", "kernels", *args])


def _one_line_error(result, *needles: str) -> None:  # noqa: ANN001
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_check_passes_with_exit_0_and_json_has_stable_keys() -> None:
    result = _run("--section", "kernels", "--case", "sqrt_f64/", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert list(out) == ["passed", "golden", "arch", "only", "cpu", "sections", "marked_passed"]
    assert out["passed"] is True and out["only"] == "sqrt_f64/"
    assert set(out["cpu"]) >= {"vendor", "model", "cpuid", "isa", "variants", "arch", "torch"}
    r = out["sections"]["kernels"]
    assert list(r)[:11] == [
        "checked",
        "passed",
        "cases",
        "records",
        "variants",
        "threads",
        "mismatch_count",
        "mismatches",
        "missing",
        "unexpected",
        "seconds",
    ]
    assert r["cases"] == 10 and r["variants"] == list(_lib.available_isas())
    assert out["sections"]["torch_ops"] == {"checked": False}


def test_a_differing_hash_exits_1_naming_the_case(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    entry = golden["kernels"]["cases"]["gemm_f32/b1_m7_k15_n17_wt"]
    entry["hash"] = entry["hash"][::-1]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(golden))
    result = _run("--golden", str(path), "--section", "kernels", "--case", "gemm_f32/b1_m7_k15")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "gemm_f32/b1_m7_k15_n17_wt [scalar, threads 1]" in result.output


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "no such file"),
        ("{not json", "is corrupt"),
        (json.dumps({"format": "something else"}), "is corrupt: not a"),
        (json.dumps({"format": kernel_golden.FORMAT, "format_version": 99, "passed_on": []}), "format_version 99"),
        (
            json.dumps(
                {
                    "format": kernel_golden.FORMAT,
                    "format_version": 1,
                    "passed_on": [],
                    "kernels": {"cases": {"exp_f32/x": {"hash": "zz", "dtype": "f32", "count": 1}}},
                }
            ),
            "32-hex-digit",
        ),
    ],
)
def test_a_missing_or_corrupt_golden_exits_2_naming_the_file(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "kernels.json"
    if content is not None:
        path.write_text(content)
    _one_line_error(_run("--golden", str(path)), str(path), needle)


def test_record_refuses_to_overwrite_and_force_writes_a_golden_that_passes(tmp_path: Path) -> None:
    _one_line_error(_run("--record", "--golden", str(GOLDEN)), str(GOLDEN), "--force")
    path = tmp_path / "kernels.json"
    path.write_text(GOLDEN.read_text())
    before = json.loads(path.read_text())
    _one_line_error(_run("--record", "--golden", str(path), "--section", "kernels"), "already exists")
    assert json.loads(path.read_text()) == before  # untouched
    result = _run("--record", "--force", "--golden", str(path), "--section", "kernels", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["recorded"] is True
    after = json.loads(path.read_text())
    assert after["kernels"]["cases"] == before["kernels"]["cases"], "recording here reproduces the committed hashes"
    assert after["torch_ops"] == before["torch_ops"], "the other section is kept"
    assert all("kernels" not in cpu["sections"] for cpu in after["passed_on"]), "re-recorded: not passed anywhere yet"
    assert not list(tmp_path.glob(".kernels.json.*")), "no temporary file left behind"
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_mark_passed_appends_this_cpu_once(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    golden["passed_on"] = []
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(golden))
    _one_line_error(
        _run("--golden", str(path), "--section", "kernels", "--case", "exp_f64/", "--mark-passed"), "--case"
    )
    for _ in range(2):
        result = _run("--golden", str(path), "--section", "kernels", "--mark-passed")
        assert result.exit_code == 0, result.output
    (entry,) = json.loads(path.read_text())["passed_on"]
    assert entry["sections"] == ["kernels"] and entry["variants"] == list(_lib.available_isas())
    assert set(entry) >= {"vendor", "model", "isa", "arch", "date", "torch"}
    # a failing check appends nothing
    golden = json.loads(path.read_text())
    golden["passed_on"] = []
    golden["kernels"]["cases"]["exp_f64/bits_1"]["hash"] = "0" * 32
    path.write_text(json.dumps(golden))
    assert _run("--golden", str(path), "--section", "kernels", "--mark-passed").exit_code == 1
    assert json.loads(path.read_text())["passed_on"] == []


def test_a_missing_or_stale_battery_exits_2_saying_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(battery.HARNESS, "native", tmp_path / "battery")
    _one_line_error(_run("--section", "kernels"), "is missing", "make battery")
    stale = tmp_path / "battery"
    stale.write_bytes(b"")
    os.utime(stale, (0, 0))
    _one_line_error(_run("--section", "kernels"), "older than its sources", "make battery")


def test_usage_errors_exit_2() -> None:
    _one_line_error(_run("--force"), "--force goes with --record")
    _one_line_error(_run("--arch", "aarch64", "--section", "torch-ops"), "torch-ops section runs natively only")
