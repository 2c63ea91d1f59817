"""`bench audit` smoke test: the suite runs and reports params/full vs off ratios (no timing asserted)."""

import torch

from titan_audit.bench import BenchOptions, run_suite


def test_bench_audit_quick_reports_both_levels():
    threads = torch.get_num_threads()
    data = run_suite("audit", BenchOptions(quick=True, repeats=1, min_batch_s=0.001)).to_dict()
    assert torch.get_num_threads() == threads, "the suite restores the thread count"
    cases = {c["case"]: c for c in data["cases"]}
    resume = cases.pop("resume check of the audit log, 10000 steps vs 20")  # --quick: 10^4 steps
    assert resume["long_parts_read"] == resume["short_parts_read"] and resume["long_parts"] > 100
    assert set(cases) == {"small-transformer step, audit params vs off", "small-transformer step, audit full vs off"}
    for case in cases.values():
        assert case["baseline"] == "Recorder level off"
        assert case["ratio"] == case["candidate_s"] / case["baseline_s"] > 0
        assert case["plain_s"] > 0 and case["threads"] == 1
    assert cases["small-transformer step, audit params vs off"]["target"] == 1.03
    assert cases["small-transformer step, audit full vs off"]["target"] == 1.10
