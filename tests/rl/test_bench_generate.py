"""`bench generate --quick --json` runs the built-in generator (native and BI) and HF transformers
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
    assert list(cases) == ["generate B=8", "generate B=8 vs HF transformers"]
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
