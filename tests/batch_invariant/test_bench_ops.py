"""`bench ops --json` follows DESIGN.md section 6's schema, names cases `<op> <shape>` and carries
issue 14's targets (a quick smoke run: the figures are not asserted, only the structure, the
targets and the ratio arithmetic)."""

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
    # issue 14's targets: gemm by two geomeans (M >= 16, M <= 4), single gemm cases untargeted
    assert targets["matmul+linear geomean M>=16"] == 1.1 and targets["matmul+linear geomean M<=4"] == 1.25
    assert targets["linear M=1 K=256 N=256"] is None and targets["matmul M=16 K=256 N=256"] is None
    groups = {c["case"]: c["cases_in_group"] for c in data["cases"] if c.get("aggregate")}
    assert groups["matmul+linear geomean M>=16"] == 2 and groups["matmul+linear geomean M<=4"] == 4
    # the gemm orders: per shape v2 vs native and v2 vs v1 (the kernel's own times, same run), aggregated
    cases = {c["case"]: c for c in data["cases"]}
    for op in ("linear", "matmul"):
        for m in (1, 4, 16):
            shape = f"M={m} K=256 N=256"
            base, v2, v2v1 = cases[f"{op} {shape}"], cases[f"{op} v2 {shape}"], cases[f"{op} v2/v1 {shape}"]
            assert v2["baseline_s"] == base["baseline_s"] and v2["candidate_s"] == base["v2_s"]
            assert v2v1["baseline_s"] == base["v1_s"] and v2v1["candidate_s"] == base["v2_s"]
            assert v2["target"] is None and v2v1["target"] is None
            assert v2v1["candidate"] == "cpu mm blocks=4 (v2)"
    assert targets["matmul+linear v2 geomean M>=16"] == 1.1 and targets["matmul+linear v2 geomean M<=4"] == 1.25
    assert targets["gemm v2/v1 geomean"] == 1.05 and groups["gemm v2/v1 geomean"] == 6
    assert groups["matmul+linear v2 geomean M>=16"] == 2 and groups["matmul+linear v2 geomean M<=4"] == 4
    # attention: the geomean <= 1.3x over every case, and a decode step of plain MHA <= 2x
    assert targets["attention geomean"] == 1.3 and groups["attention geomean"] == 3
    assert targets["attention decode B=2 Hq=4 Hkv=4 Tq=1 Tk=128 D=32"] == 2.0
    assert targets["attention decode B=2 Hq=4 Hkv=2 Tq=1 Tk=128 D=32"] is None
    assert targets["attention prefill B=1 Hq=4 Hkv=2 Tq=128 Tk=128 D=32"] is None
    for op in ("softmax", "log_softmax", "rms_norm"):
        assert targets[f"{op} M=8 N=512"] == 1.5
    # bfloat16 gemm: a figure without a target, its dtype named
    bf16 = cases["linear bf16 M=4 K=256 N=256"]
    assert bf16["target"] is None and bf16["dtype"] == "bfloat16" and bf16["candidate"] == "bi.linear"
    assert {"geomean_ratio", "max_ratio"} <= set(data["summary"])
