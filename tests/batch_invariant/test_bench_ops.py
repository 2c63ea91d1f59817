"""`bench ops --json` follows DESIGN.md section 6's schema and names cases `<op> <shape>` (a quick
smoke run: the figures are not asserted, only the structure and the ratio arithmetic)."""

import json
import math

from click.testing import CliRunner

from titan_audit.cli.main import cli


def test_bench_ops_quick_json() -> None:
    result = CliRunner().invoke(cli, ["bench", "ops", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "ops"
    names = [c["case"] for c in data["cases"]]
    assert "linear M=4 K=256 N=256" in names and "matmul M=1 K=256 N=256" in names
    assert any(n.startswith("attention prefill") for n in names)
    assert any(n.startswith("attention decode") for n in names)
    for case in data["cases"]:
        assert math.isclose(case["ratio"], case["candidate_s"] / case["baseline_s"])
    targets = {c["case"]: c["target"] for c in data["cases"]}
    assert targets["linear M=1 K=256 N=256"] == 4.0 and targets["linear M=16 K=256 N=256"] == 2.0
    # attention's M is the query rows per KV head: quick prefill 128 * 4/2 rows, decode 1 * 4/2
    assert targets["attention prefill B=1 Hq=4 Hkv=2 Tq=128 Tk=128 D=32"] == 2.0
    assert targets["attention decode B=2 Hq=4 Hkv=2 Tq=1 Tk=128 D=32"] == 4.0
    assert targets["matmul+linear geomean M>=4"] == 1.15 and targets["attention geomean"] == 1.5
    assert {"geomean_ratio", "max_ratio"} <= set(data["summary"])
