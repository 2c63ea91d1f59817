"""`bench rl --quick --repeats 1 --json`: the schema and the phase keys (not timed); the TRL peer
cases skipped with the reason when trl cannot be imported, and the W=1 one given a figure when it
can (`--quick` skips the all-cores case: torchrun and a second TRL process)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner

from titan_audit.bench import rl_suite, trl_peer
from titan_audit.cli.main import cli

PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")
TRL_CASES = ["rl rl-tiny W=1 vs TRL", "rl rl-tiny all cores (W=2 vs TRL threads=2)"]
HAS_TRL = importlib.util.find_spec("trl") is not None


def bench_rl() -> dict:
    result = CliRunner().invoke(cli, ["bench", "rl", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "rl" and set(data["summary"]) >= {"geomean_ratio", "targets", "missed"}
    first = data["cases"][0]
    assert (first["case"], first["baseline"], first["candidate"]) == ("rl rl-tiny W=1", "native ops", "BI mode")
    for side in ("baseline", "candidate"):
        assert first[f"{side}_s"] > 0
        for phase in PHASES:
            assert first[f"{side}_seconds_{phase}"] >= 0
    return data


def test_bench_rl_without_trl_skips_the_peer_cases(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` fails, find_spec finds nothing
    assert trl_peer.trl_missing() == "trl is not installed (pip install 'titan-audit[peers]')"
    data = bench_rl()
    assert len(data["cases"]) == 1  # no figure for a peer that did not run
    skipped = data["cases"][0]["skipped"]
    assert [s["case"] for s in skipped] == TRL_CASES
    assert all(s["reason"] == trl_peer.trl_missing() for s in skipped)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="needs trl (the peers extra)")
def test_bench_rl_with_trl_times_the_peer():
    assert trl_peer.trl_missing() is None  # control of the test above: trl is here
    data = bench_rl()
    cases = data["cases"]
    assert [c["case"] for c in cases[1:]] == TRL_CASES[:1]
    assert cases[0]["skipped"] == [{"case": TRL_CASES[1], "reason": rl_suite.QUICK_SKIP}]  # full suite only
    w1 = cases[1]
    assert (w1["baseline"], w1["candidate"]) == ("TRL GRPOTrainer, 1 thread", "BI mode")
    assert w1["candidate_s"] == cases[0]["candidate_s"]  # the same BI run as the first case
    assert w1["target"] == 0.8 and w1["baseline_s"] > 0 and w1["candidate_s"] > 0
    assert w1["ratio"] == w1["candidate_s"] / w1["baseline_s"]
    assert w1["trl_version"] == "1.16.0"


def test_byte_tokenizer_has_our_ids():
    pytest.importorskip("transformers")
    from titan_audit.data.tokenizer import ByteTokenizer

    text = "Reverse: abcé ->  "
    hf = trl_peer.byte_tokenizer()
    assert hf(text=[text])["input_ids"][0] == ByteTokenizer().encode_batch([text])[0].tolist()
    assert (hf.eos_token_id, hf.pad_token_id) == (ByteTokenizer.eos_id, ByteTokenizer.pad_id)
    assert hf.decode([97, 98, 256, 300, 99], skip_special_tokens=True) == "abc"  # ids >= 258 are dropped
    # control: a tokenizer that merges would not give one id per byte
    assert len(hf(text=[text])["input_ids"][0]) == len(text.encode("utf-8"))
