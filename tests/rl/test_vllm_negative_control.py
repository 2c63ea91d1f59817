"""Negative control of the zero-gap tests: vLLM's OWN model code for the checkpoint (its Qwen3,
its CPU kernels; `implementation="vllm"`) on the same exported weights, sampled by the same keyed
sampler, reports log-probs that are close to the trainer's but not bitwise equal: the gap the
batch-invariant model removes is real here, so the zero-gap tests can fail."""

from __future__ import annotations

import pytest
import torch
from vllm_common import bits, needs_vllm, one_thread, random_requests, tiny

from titan_audit.rl.generator import SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def model():
    return tiny("tiny-dense")


@pytest.fixture(scope="module")
def gen(model):
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

    with one_thread():
        generator = VllmGenerator(
            model,
            VllmGeneratorConfig(
                implementation="vllm", max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory_bytes=64 << 20
            ),
        )
        yield generator
        generator.close()


def test_vllm_own_qwen3_has_a_nonzero_gap(gen, model):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = random_requests(40, 512, prompts=6, max_len=120)
    with one_thread():
        samples = gen.generate(requests, params)
    assert gen.llm.collective_rpc("titan_status")[0]["architecture"] == "Qwen3ForCausalLM"
    generated = torch.cat([s.logprobs for s in samples])
    with torch.no_grad():
        trainer = torch.cat(
            sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples], params.temperature)
        )
    differing = int((bits(generated) != bits(trainer)).sum())
    max_abs = float((generated - trainer).abs().max())
    print(
        f"vLLM's own Qwen3 vs the trainer: {differing}/{generated.numel()} log-probs differ, max |diff| {max_abs:.3g}"
    )
    assert differing > 0  # the gap is real
    assert max_abs < 1e-3  # and it is the same model: float rounding, not a wrong weight


def test_weight_sync_is_refused_for_vllm_own_model(gen, model):
    with pytest.raises(ValueError, match="implementation='titan'"):
        gen.load_weights(model.state_dict(), 1)
