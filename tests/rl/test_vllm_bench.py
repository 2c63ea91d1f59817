"""`bench generate --generator vllm --quick` runs both engines in one process and reports the
vLLM-default vs vLLM-BI ratio (a smoke run: figures not meaningful at quick sizes)."""

from __future__ import annotations

import pytest
from vllm_common import needs_vllm, one_thread

from titan_audit.bench import BenchOptions, run_suite

pytestmark = [*needs_vllm, pytest.mark.slow]


def test_bench_generate_vllm_quick():
    with one_thread():
        result = run_suite("generate", BenchOptions(quick=True, generator="vllm")).to_dict()
    (case,) = result["cases"]
    assert case["case"] == "generate B=8 vLLM" and case["target"] == 1.25
    assert case["baseline"].startswith("vLLM default") and "BI mode" in case["candidate"]
    assert case["ratio"] > 0 and case["builtin_bi_tokens_per_s"] > 0
