"""The vLLM generator in BI mode on the tiny MoE model (one in-process engine for the module):
zero gap against the trainer and the built-in generator's samples on random prompt sets, with
chunked prefill, prefix caching and continuous batching; decode == a second prefill."""

from __future__ import annotations

import dataclasses

import pytest
from vllm_common import differing, needs_vllm, one_thread, random_requests, same_samples, tiny

from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs

pytestmark = needs_vllm
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(3, 5, 7))


@pytest.fixture(scope="module")
def model():
    return tiny("tiny-moe", seed=1)


@pytest.fixture(scope="module")
def gen(model):
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

    config = VllmGeneratorConfig(
        batch_invariant=True, max_num_batched_tokens=48, max_num_seqs=6, kv_cache_memory_bytes=64 << 20
    )
    with one_thread():
        generator = VllmGenerator(model, config)
        yield generator
        generator.close()


def test_moe_zero_gap_and_builtin_samples(gen, model):
    requests = random_requests(30, 512, prompts=7, max_len=150)
    with one_thread():
        samples = gen.generate(requests, PARAMS)
        repeat = gen.generate(requests, PARAMS)
    assert model.config.is_moe and len(requests) > 6 and any(len(r.prompt_ids) > 48 for r in requests)
    trainer = sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples], PARAMS.temperature)
    assert [differing(s.logprobs, t) for s, t in zip(samples, trainer)] == [0] * len(samples)
    builtin = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=4))
    assert same_samples(samples, builtin.generate(requests, PARAMS)) == []
    assert same_samples(samples, repeat) == []


def test_moe_decode_equals_second_prefill(gen):
    requests = random_requests(31, 512, prompts=3, max_len=100, samples=(1, 1))
    params = dataclasses.replace(PARAMS, stop_token_ids=())
    with one_thread():
        samples = gen.generate(requests, params)
        cut = [(s, t) for s in samples for t in range(1, len(s.tokens))]
        again = gen.continue_samples(
            [s for s, _ in cut], dataclasses.replace(params, max_new_tokens=1), [t for _, t in cut]
        )
    assert [(a.tokens, differing(a.logprobs, s.logprobs[t : t + 1])) for (s, t), a in zip(cut, again)] == [
        ([s.tokens[t]], 0) for s, t in cut
    ]
