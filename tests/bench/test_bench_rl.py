"""`bench rl --quick --repeats 1 --json`: the schema and the phase keys (not timed); the TRL peer
cases skipped with the reason when trl cannot be imported, and the W=1 one given a figure when it
can (`--quick` skips the all-cores case: torchrun and a second TRL process, and the real-width
case). The real-width case's wiring (its config: qwen3-0.6b widths, the same shape on both sides,
1 thread each; left out of `--quick`) with the sides' runs replaced by recorders: no real-width
run here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner

from titan_audit.bench import rl_suite, trl_peer
from titan_audit.bench.core import BenchOptions
from titan_audit.cli.main import cli

PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")
REAL_WIDTH_CASE = "rl qwen3-0.6b widths L=2 W=1 vs TRL"
TRL_CASES = ["rl rl-tiny W=1 vs TRL", "rl rl-tiny all cores (W=2 vs TRL threads=2)", REAL_WIDTH_CASE]
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
    assert [s["case"] for s in skipped] == [rl_suite.THREADS_CASE, *TRL_CASES]
    assert skipped[0]["reason"] == rl_suite.THREADS_QUICK_SKIP  # needs no trl: only --quick leaves it out
    assert all(s["reason"] == trl_peer.trl_missing() for s in skipped[1:])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="needs trl (the peers extra)")
def test_bench_rl_with_trl_times_the_peer():
    assert trl_peer.trl_missing() is None  # control of the test above: trl is here
    data = bench_rl()
    cases = data["cases"]
    assert [c["case"] for c in cases[1:]] == TRL_CASES[:1]
    assert cases[0]["skipped"] == [  # full suite only
        {"case": rl_suite.THREADS_CASE, "reason": rl_suite.THREADS_QUICK_SKIP},
        {"case": TRL_CASES[1], "reason": rl_suite.QUICK_SKIP},
        {"case": REAL_WIDTH_CASE, "reason": rl_suite.REAL_WIDTH_QUICK_SKIP},
    ]
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


def test_real_width_config_has_the_widths_and_the_small_shape():
    config = rl_suite.real_width_config()
    m = config.model.model_config()
    widths = (m.vocab_size, m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim)
    assert widths == (151_936, 1024, 16, 8, 128)
    assert (m.intermediate_size, m.num_hidden_layers, m.tie_word_embeddings) == (3072, 2, True)
    shape = (config.task.prompts_per_step, config.task.samples_per_prompt, config.sampling.max_new_tokens)
    assert shape == (2, 4, 16) and config.parallel.threads == 1 and config.steps == rl_suite.REAL_WIDTH_STEPS == 5
    assert (config.audit.level, config.checkpoint.interval, config.determinism.batch_invariant) == ("off", 0, True)
    assert config.task.name == "reversal-short"  # the rl-tiny recipe's task, prompts and reward
    # control: the rl-tiny cases keep the tiny model and the recipe's shape
    tiny = rl_suite._config([], quick=False)
    assert tiny.model.model_config().hidden_size == 256 and tiny.task.samples_per_prompt == 8


def recorded_suite(monkeypatch, quick: bool) -> tuple[list, list]:
    """rl_suite with trl present and both sides' runs replaced by recorders (distinct figures)."""
    ours, trl = [], []

    def run_side(overrides, quick, out, nproc=None, config=None):
        ours.append((config or rl_suite._config(overrides, quick), nproc))
        return {"seconds": float(len(ours)), **{f"seconds_{p}": 0.1 for p in PHASES}}

    def trl_step_seconds(config, *, threads):
        trl.append((config, threads))
        return {"seconds": 10.0 + len(trl), "trl_version": "x", "optimizer": "o", "loss_type": "l"}

    monkeypatch.setattr(trl_peer, "trl_missing", lambda: None)
    monkeypatch.setattr(rl_suite, "_run_side", run_side)
    monkeypatch.setattr(trl_peer, "trl_step_seconds", trl_step_seconds)
    cases = rl_suite.rl_suite(BenchOptions(quick=quick, repeats=1), lambda name: None)
    return cases, [ours, trl]


def test_real_width_case_runs_the_same_config_on_both_sides(monkeypatch):
    cases, (ours, trl) = recorded_suite(monkeypatch, quick=False)
    assert [c.case for c in cases] == ["rl rl-tiny W=1", rl_suite.THREADS_CASE, *TRL_CASES]
    assert "skipped" not in cases[0].extra
    real = cases[-1]
    assert (real.baseline, real.candidate) == (rl_suite.TRL_REAL, rl_suite.BI_REAL) and real.target == 1.0
    (our_config, nproc), (trl_config, threads) = ours[-1], trl[-1]
    assert our_config == trl_config == rl_suite.real_width_config() and (nproc, threads) == (None, 1)
    assert (real.candidate_s, real.baseline_s) == (float(len(ours)), 10.0 + len(trl))  # its own sides' figures
    assert real.extra["candidate_seconds_backward"] == 0.1 and real.extra["trl_loss_type"] == "l"
    # control: the rl-tiny TRL cases ran the tiny model
    assert all(c.model.model_config().hidden_size == 256 for c, _ in trl[:-1])


def test_threads_case_is_the_bi_side_again_with_two_threads(monkeypatch):
    cases, (ours, _) = recorded_suite(monkeypatch, quick=False)
    case = next(c for c in cases if c.case == rl_suite.THREADS_CASE)
    assert (case.baseline, case.candidate, case.target) == (rl_suite.BI, rl_suite.THREADS_SIDE, 1.0)
    # sides in order: native, BI, BI 2 threads, BI W=2, real width
    (bi, _), (two, nproc) = ours[1], ours[2]
    assert bi.parallel.threads == 1 and two.parallel.threads == 2 and nproc is None  # W=1, threads the only change
    assert dataclasses.replace(two, parallel=bi.parallel) == bi
    assert (case.baseline_s, case.candidate_s) == (2.0, 3.0) and case.baseline_s == cases[0].candidate_s


def test_quick_leaves_the_real_width_case_out(monkeypatch):
    cases, (ours, trl) = recorded_suite(monkeypatch, quick=True)
    assert [c.case for c in cases] == ["rl rl-tiny W=1", TRL_CASES[0]]
    assert cases[0].extra["skipped"][-1] == {"case": REAL_WIDTH_CASE, "reason": rl_suite.REAL_WIDTH_QUICK_SKIP}
    assert all(c.model.model_config().hidden_size == 256 for c, _ in ours + trl)  # nothing ran at real width
