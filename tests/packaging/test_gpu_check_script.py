"""scripts/gpu_check.sh on a CPU machine: `--dry-run` says ready (exit 0) and prints the plan when
every wheel, the kernel build and the test files are present, and names what is missing (exit 2)
otherwise; a run without a GPU stops at its env stage with exit 2 and the stage in its JSON. And
scripts/gpu_check_record.py: a stage's figures are merged into the JSON, the earlier stages kept."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _wheels() -> list[str]:
    block = re.search(r"^WHEELS=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    assert block is not None
    return block.group(1).split()


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_dry_run_is_ready_with_every_wheel_and_names_a_missing_one(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for spec in _wheels():
        name, version = spec.split("==")
        (wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    ready = _run("--dry-run", WHEEL_DIR=str(wheels))
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert "dry run: ready" in ready.stdout and "plan (budget" in ready.stdout and "g4_onpolicy" in ready.stdout
    (wheels / next(wheels.glob("zarr-*"))).unlink()  # control: one wheel gone
    missing = _run("--dry-run", WHEEL_DIR=str(wheels))
    assert missing.returncode == 2
    assert "missing wheel: zarr==" in missing.stdout and "dry run: not ready" in missing.stdout


def test_without_a_gpu_the_run_stops_at_env_with_exit_2(tmp_path):
    out = tmp_path / "out"
    result = _run(OUT=str(out), WHEEL_DIR=str(tmp_path / "none"), SITE=str(tmp_path / "site"))
    assert result.returncode == 2, result.stdout + result.stderr
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    assert list(stages) == ["env"] and stages["env"]["status"] == "failed"
    assert stages["env"]["figures"]["gpu"] is None and stages["env"]["figures"]["python"]


def test_bad_arguments_exit_2():
    assert _run("--gpu").returncode == 2


def test_record_merges_stages_and_reads_junit_and_bench(tmp_path):
    record = [sys.executable, str(ROOT / "scripts" / "gpu_check_record.py")]
    out = tmp_path / "gpu_check.json"
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/><testcase classname="a" name="bad">'
        '<failure message="x"/></testcase><testcase classname="a" name="s"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    bench = tmp_path / "b.json"
    case = {"baseline_s": 1.0, "candidate_s": 1.25, "ratio": 1.25, "device": "H200"}
    cases = [{"case": "cuda matmul", "target": 0.8, "met_target": False, **case}, {"case": "cpu x", **case}]
    bench.write_text(json.dumps({"cases": cases}))
    subprocess.run([*record, str(out), "gpu_tests", "1", "12.34", "pytest", str(junit)], check=True)
    subprocess.run([*record, str(out), "bench_ops", "124", "70", "bench", str(bench)], check=True)
    subprocess.run([*record, str(out), "g1_train", "0", "3", "compare", str(tmp_path / "absent.json")], check=True)
    stages = json.loads(out.read_text())["stages"]
    assert stages["gpu_tests"]["status"] == "failed" and stages["gpu_tests"]["seconds"] == 12.3
    assert stages["gpu_tests"]["figures"] == {"passed": 1, "failed": 1, "skipped": 1, "failures": ["a::bad"]}
    assert stages["bench_ops"]["status"] == "timeout"
    assert [c["case"] for c in stages["bench_ops"]["figures"]["cases"]] == ["cuda matmul"]
    assert stages["bench_ops"]["figures"]["targets_missed"] == 1
    assert stages["g1_train"]["figures"] is None and "absent.json" in stages["g1_train"]["artifact_error"]
