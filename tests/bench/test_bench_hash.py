"""`bench hash --json` follows DESIGN.md section 6's schema (a smoke run; no timing asserted)."""

import json
import math

from click.testing import CliRunner

from titan_audit.cli.main import cli

CASE_KEYS = {"case", "baseline", "candidate", "baseline_s", "candidate_s", "ratio", "target"}


def test_bench_hash_json_schema():
    result = CliRunner().invoke(cli, ["bench", "hash", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "hash"
    assert data["machine"]["torch_version"]
    assert len(data["cases"]) == 4
    for case in data["cases"]:
        assert CASE_KEYS <= set(case)
        assert math.isclose(case["ratio"], case["candidate_s"] / case["baseline_s"])
        assert case["sha256_s"] > 0
    assert {"geomean_ratio", "max_ratio"} <= set(data["summary"])
    assert data["cases"][-1]["case"].startswith("fingerprint_many state_dict")


def test_unknown_suite_is_a_usage_error():
    result = CliRunner().invoke(cli, ["bench", "no-such-suite"])
    assert result.exit_code == 2 and "no-such-suite" in result.output
