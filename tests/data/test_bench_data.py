"""`bench data --json` follows DESIGN.md section 6's schema (a quick smoke run; no timing asserted)."""

import json
import math

from click.testing import CliRunner

from titan_audit.cli.main import cli

CASE_KEYS = {"case", "baseline", "candidate", "baseline_s", "candidate_s", "ratio", "target"}


def test_bench_data_json_schema():
    result = CliRunner().invoke(cli, ["bench", "data", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "data" and data["machine"]["torch_version"]
    names = [c["case"] for c in data["cases"]]
    assert names[0].startswith("tokens/s workers=0") and names[-1].startswith("resume: time to first batch")
    for case in data["cases"]:
        assert CASE_KEYS <= set(case)
        assert math.isclose(case["ratio"], case["candidate_s"] / case["baseline_s"])
    throughput = data["cases"][0]
    assert throughput["elastic_tokens_per_s"] > 0 and throughput["plain_tokens_per_s"] > 0
    assert "stateful_dataloader_s" in throughput
    assert data["cases"][-1]["epoch_at_far_step"] > 0
    assert {"geomean_ratio", "max_ratio"} <= set(data["summary"])
