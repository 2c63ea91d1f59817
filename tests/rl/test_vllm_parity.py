"""The vLLM generator in BI mode (dense model, one in-process engine for the module): the parity
trio, zero gap against the trainer on random prompt sets with continuous batching, chunked
prefill and prefix caching, the same samples as the built-in generator, weight sync in place.

Engine: max_num_batched_tokens=64 (prompts longer than 64 tokens are prefilled in chunks, and
prefills share steps with decodes), max_num_seqs=8 (requests queue and join as others finish),
prefix caching on (block size 32: prompts sharing 32+ tokens hit the cache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm_common import differing, needs_vllm, one_thread, random_requests, same_samples, tiny

from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs
from titan_audit.rl.rollouts import RolloutJob, RolloutWorker, WeightSyncError, trainer_fingerprint

pytestmark = needs_vllm
PARAMS = SamplingParams(temperature=0.9, top_k=64, top_p=0.95, max_new_tokens=10, stop_token_ids=(3, 5, 7, 11))


@pytest.fixture(scope="module")
def model():
    return tiny("tiny-dense")


@pytest.fixture(scope="module")
def gen(model):
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

    config = VllmGeneratorConfig(
        batch_invariant=True, max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory_bytes=64 << 20
    )
    with one_thread():
        generator = VllmGenerator(model, config)
        yield generator
        generator.close()


@pytest.fixture
def synced(gen, model):
    """The engine holds `model`'s weights again (a test may have loaded others)."""
    gen.load_weights(model.state_dict(), 0)
    return gen


def gaps(model, samples, temperature=PARAMS.temperature) -> list[str]:
    """Samples whose log-probs are not bitwise the trainer's recomputation."""
    trainer = sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples], temperature)
    return [
        f"{s.key}: {differing(s.logprobs, t)}/{len(s.tokens)} differ"
        for s, t in zip(samples, trainer)
        if differing(s.logprobs, t)
    ]


# ------------------------------------------------------------------------------------- the trio
def test_trainer_prefill_at_batch_2_equals_batch_5(model):
    requests = random_requests(1, 512, prompts=5, max_len=90, samples=(1, 1))
    prompts = [r.prompt_ids[:-3] for r in requests]
    completions = [r.prompt_ids[-3:] for r in requests]
    at2 = sequence_logprobs(model, prompts[:2], completions[:2])
    at5 = sequence_logprobs(model, prompts, completions)
    assert all(p for p in prompts) and [differing(a, b) for a, b in zip(at2, at5)] == [0, 0]


def test_trainer_prefill_equals_vllm_prefill(synced, model):
    """vLLM's first token after a prompt prefix (a chunked prefill for the long ones, prefix-cache
    hits for the later prefixes) has the trainer's log-prob at every cut position."""
    g = torch.Generator().manual_seed(2)
    prompt = tuple(torch.randint(0, 512, (150,), generator=g).tolist())
    cuts = [1, 2, 31, 32, 33, 63, 64, 65, 100, 128, 149, 150]
    requests = [GenerationRequest(prompt[:k], SampleKey(2, 0, i, 0)) for i, k in enumerate(cuts)]
    params = dataclasses.replace(PARAMS, max_new_tokens=1, stop_token_ids=())
    with one_thread():
        samples = synced.generate(requests, params)
    assert [len(s.tokens) for s in samples] == [1] * len(cuts)
    assert gaps(model, samples) == []


def test_vllm_decode_equals_second_vllm_prefill(synced):
    """Each decoded token's log-prob equals the one vLLM reports when it prefills prompt + the
    tokens before it and draws that position again (same key, decode offset t)."""
    requests = random_requests(3, 512, prompts=4, max_len=120, samples=(1, 2))
    params = dataclasses.replace(PARAMS, stop_token_ids=())
    with one_thread():
        samples = synced.generate(requests, params)
        cut = [(s, t) for s in samples for t in range(len(s.tokens))]
        again = synced.continue_samples(
            [s for s, _ in cut], dataclasses.replace(params, max_new_tokens=1), [t for _, t in cut]
        )
    assert len(cut) == sum(len(s.tokens) for s in samples) > 40
    bad = [
        (s.key, t)
        for (s, t), a in zip(cut, again)
        if a.tokens != [s.tokens[t]] or differing(a.logprobs, s.logprobs[t : t + 1])
    ]
    assert bad == []


# ------------------------------------------------------------------------ zero gap, same as builtin
@pytest.mark.parametrize("seed", [10, 11])
def test_zero_gap_and_builtin_samples_on_random_prompt_sets(synced, model, seed):
    requests = random_requests(seed, 512, prompts=9, max_len=200)
    with one_thread():
        samples = synced.generate(requests, PARAMS)
        repeat = synced.generate(requests, PARAMS)  # prompts now in the prefix cache
    assert len(requests) > 8  # more than max_num_seqs: requests join the running batch
    assert any(len(r.prompt_ids) > 64 for r in requests)  # chunked prefill
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    assert gaps(model, samples) == []
    builtin = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=5))
    assert same_samples(samples, builtin.generate(requests, PARAMS)) == []
    assert same_samples(samples, repeat) == []
    assert all(s.policy_version == 0 for s in samples)


def test_sample_alone_equals_sample_in_a_batch(synced):
    requests = random_requests(12, 512, prompts=6, max_len=100)
    with one_thread():
        batch = synced.generate(requests, PARAMS)
        alone = [synced.generate([r], PARAMS)[0] for r in requests[::3]]
    assert same_samples(batch[::3], alone) == []


def test_equal_length_prompts_prefill_in_one_call_with_the_bits_of_each_alone(synced, monkeypatch):
    """Fresh prompts of one length are one prefill run (one attention call per layer for all of
    them, attention.py's `_Plan.prefills`): each sample is bitwise the one generated alone."""
    from titan_audit.rl.vllm import attention

    g = torch.Generator().manual_seed(31)
    requests = [
        GenerationRequest(tuple(torch.randint(20, 512, (12,), generator=g).tolist()), SampleKey(0, 0, i, 0))
        for i in range(5)
    ]  # 5 x 12 tokens fit one step of 64
    run_sizes = []
    plan = attention._Plan.__init__

    def recording(self, *args):
        plan(self, *args)
        run_sizes.extend(count for _start, _q_len, count, _blocks, _positions, _lens in self.prefills)

    monkeypatch.setattr(attention._Plan, "__init__", recording)
    with one_thread():
        batch = synced.generate(requests, PARAMS)
        alone = [synced.generate([r], PARAMS)[0] for r in requests]
    assert max(run_sizes) == 5  # the batch's prompts were one call
    assert same_samples(batch, alone) == []


def test_the_cache_is_read_in_place_with_the_bits_of_the_gather(synced, model, monkeypatch):
    """In BI mode attention reads vLLM's cache through its block table (the paged kernel runs,
    `_gather` never does) and the samples are bitwise those of the dense gather (`_attend` forced
    onto `_gather` + `_attention`: the read before the paged kernel), with zero gap. Control
    (constructed): the in-place read with blocks 0 and 1 of every long-enough request swapped in
    its table gives other samples."""
    from titan_audit.batch_invariant import cpu
    from titan_audit.rl.vllm import attention

    requests = random_requests(41, 512, prompts=4, max_len=100)
    impl, kernel, calls = attention.TitanAttentionImpl, cpu.paged_attention, []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    def no_gather(*args):
        raise AssertionError("_gather ran in BI mode")

    def gathered(self, cache_BNHCD, q_RHTD, blocks_RB, seq_lens_R, positions_RT):
        return attention._attention(q_RHTD, *self._gather(cache_BNHCD, blocks_RB), positions_RT)

    real_attend = impl._attend

    def swapped(self, cache_BNHCD, q_RHTD, blocks_RB, seq_lens_R, positions_RT):
        table = blocks_RB.clone()
        rows = seq_lens_R > 2 * cache_BNHCD.shape[1]  # requests holding blocks 0 and 1 in full
        if bool(rows.any()):
            table[rows, 0], table[rows, 1] = blocks_RB[rows, 1], blocks_RB[rows, 0]
        return real_attend(self, cache_BNHCD, q_RHTD, table, seq_lens_R, positions_RT)

    with one_thread():
        with monkeypatch.context() as m:
            m.setattr(cpu, "paged_attention", counted)
            m.setattr(impl, "_gather", no_gather)
            in_place = synced.generate(requests, PARAMS)
        assert calls
        with monkeypatch.context() as m:
            m.setattr(impl, "_attend", gathered)
            dense = synced.generate(requests, PARAMS)
        with monkeypatch.context() as m:
            m.setattr(impl, "_attend", swapped)
            control = synced.generate(requests, PARAMS)
    assert same_samples(in_place, dense) == []
    assert gaps(model, in_place) == []
    assert same_samples(in_place, control) != []


# ----------------------------------------------------------------------------------- weight sync
def perturbed(model, scale: float):
    other = tiny("tiny-dense")
    with torch.no_grad():
        for name, t in other.state_dict().items():
            t.copy_(model.state_dict()[name] * scale)
    return other


def test_weight_sync_in_place_then_fingerprint_and_zero_gap(synced, model):
    requests = random_requests(20, 512, prompts=4, max_len=80)
    with one_thread():
        before = synced.generate(requests, PARAMS)
        new = perturbed(model, 1.5)
        synced.load_weights(new.state_dict(), 7)
        after = synced.generate(requests, PARAMS)
    assert synced.weights_fingerprint() == trainer_fingerprint(new.state_dict())
    assert synced.weights_fingerprint() != trainer_fingerprint(model.state_dict())
    assert synced.policy_version == 7 and {s.policy_version for s in after} == {7}
    assert gaps(new, after) == []
    assert same_samples(before, after) != []  # the new weights are in use


def test_prefix_cache_reset_on_sync_is_needed(synced, model, monkeypatch):
    """Negative control: without the prefix-cache reset, cached prompts keep the old weights' KV
    and the log-probs no longer match the new weights."""
    g = torch.Generator().manual_seed(21)
    prompt = tuple(torch.randint(0, 512, (96,), generator=g).tolist())
    requests = [GenerationRequest(prompt, SampleKey(21, 0, 0, j)) for j in range(3)]
    with one_thread():
        synced.generate(requests, PARAMS)  # caches the prompt's 3 full blocks
        new = perturbed(model, 1.5)
        monkeypatch.setattr(synced.llm, "reset_prefix_cache", lambda *a, **k: True)
        synced.load_weights(new.state_dict(), 1)
        stale = synced.generate(requests, PARAMS)
    assert gaps(new, stale) != []


def test_fingerprint_mismatch_stops_the_rollout_naming_the_tensor(synced, model):
    def corrupt(worker):
        with torch.no_grad():
            worker.model_runner.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0

    synced.llm.collective_rpc(corrupt)
    worker = RolloutWorker(synced, max_in_flight=1)
    try:
        worker.submit(
            RolloutJob(
                3,
                0,
                None,
                trainer_fingerprint(model.state_dict()),
                random_requests(4, 512, prompts=1, max_len=8),
                PARAMS,
            )
        )
        with pytest.raises(WeightSyncError, match=r"tensor 'layers\.1\.mlp\.up_proj\.weight' differs"):
            worker.take(3)
    finally:
        worker.close()


def test_bad_requests_fail_before_generating(synced):
    ok = GenerationRequest((1, 2, 3), SampleKey(0, 0, 0, 0))
    cases = [
        ([GenerationRequest((), SampleKey(0, 0, 1, 0))], r"request 0 .*empty prompt"),
        ([ok, GenerationRequest((1, 512), SampleKey(0, 0, 1, 0))], r"request 1 .*token id 512"),
        ([GenerationRequest((1,) * 1020, SampleKey(0, 0, 1, 0))], r"exceeds the model's context"),
        ([ok, ok], r"request 1 .*the same sample key as request 0"),
        ([ok, GenerationRequest((1, 2), SampleKey(0, 0, 0, 1))], r"different prompt tokens"),
    ]
    for requests, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            synced.generate(requests, PARAMS)
    state = dict(tiny().state_dict())
    state["norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"tensor 'norm\.weight' is torch.float32 \(3,\)"):
        synced.load_weights(state, 1)
    del state["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm\.weight'\]"):
        synced.load_weights(state, 1)
