"""`bench generate --quick --json` runs the built-in generator (native and BI), HF transformers and
a BI decode step with the paged cache gathered and read in place (whose logits are the same bits),
and follows the bench schema (a smoke run: the figures are not checked)."""

import json

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli


@pytest.mark.slow
def test_bench_generate_quick_json_schema():
    pytest.importorskip("transformers")
    args = ["bench", "generate", "--quick", "--repeats", "1", "--threads", "1", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "generate"
    cases = {c["case"]: c for c in data["cases"]}
    assert list(cases) == ["generate B=8", "generate B=8 vs HF transformers", "decode S=256 B=2"]
    decode = cases.pop("decode S=256 B=2")
    assert decode["baseline"] == "paged cache, dense gather" and decode["candidate"] == "paged cache, read in place"
    assert decode["target"] is None and decode["logits_bitwise_equal"] is True
    assert (decode["cached_tokens"], decode["decode_batch"], decode["new_tokens"]) == (256, 2, 2)
    assert decode["candidate_ms_per_token"] == pytest.approx(1e3 * decode["candidate_s"] / 2)
    bi_case, hf_case = cases.values()
    assert bi_case["target"] == 1.25 and hf_case["target"] is None
    assert bi_case["baseline"] == "builtin generator, native ops"
    assert bi_case["candidate"] == "builtin generator, BI mode"
    assert hf_case["baseline"] == "HF transformers generate"
    for case in cases.values():
        assert case["ratio"] > 0 and case["new_tokens"] == 8 * 4
        assert case["baseline_tokens_per_s"] == pytest.approx(case["new_tokens"] / case["baseline_s"])
        assert case["candidate_tokens_per_s"] == pytest.approx(case["new_tokens"] / case["candidate_s"])
    assert hf_case["builtin_native_tokens_per_s"] == pytest.approx(bi_case["baseline_tokens_per_s"])
