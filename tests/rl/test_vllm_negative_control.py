"""Negative control of the vLLM zero-gap tests, constructed: our model inside vLLM in BI mode,
synced with the trainer's weights one ulp off in one element (rl/control.py, what an RL run with
`control = "generator-weight-ulp"` sends it), reports log-probs that differ from the trainer's
recomputation, so the zero-gap comparison can fail whatever the CPU's libraries do.

Also reported, not asserted as a control: vLLM's OWN model code for the checkpoint (its Qwen3, its
CPU kernels; `implementation="vllm"`) on the same exported weights, sampled by the same keyed
sampler. Whether its log-probs differ from the trainer's in any bit depends on what those kernels
do on this CPU; the test asserts only that it is the same model (|diff| < 1e-3) and prints the gap."""

from __future__ import annotations

import pytest
import torch
from vllm_common import bits, needs_vllm, one_thread, random_requests, tiny

from titan_audit.rl.control import generator_weights
from titan_audit.rl.generator import SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs

pytestmark = needs_vllm

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def model():
    return tiny("tiny-dense")


def _gap(model, samples) -> tuple[int, float, int]:
    """(log-probs whose bits differ from the trainer's recomputation, max |diff|, log-probs compared)."""
    generated = torch.cat([s.logprobs for s in samples])
    with torch.no_grad():
        trainer = torch.cat(
            sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples], PARAMS.temperature)
        )
    return int((bits(generated) != bits(trainer)).sum()), float((generated - trainer).abs().max()), generated.numel()


def test_weights_one_ulp_off_in_our_bi_model_leave_a_gap(model):
    """First in this module: its engine is closed before the module's vLLM-model engine starts."""
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

    config = VllmGeneratorConfig(
        batch_invariant=True, max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory_bytes=64 << 20
    )
    requests = random_requests(41, 512, prompts=4, max_len=60)
    with one_thread():
        gen = VllmGenerator(model, config)
        try:
            exact = gen.generate(requests, PARAMS)
            gen.load_weights(generator_weights(model.state_dict(), "generator-weight-ulp"), 1)
            control = gen.generate(requests, PARAMS)
        finally:
            gen.close()
    assert _gap(model, exact)[0] == 0  # the synced engine: zero gap
    differing, max_abs, compared = _gap(model, control)
    print(f"weights one ulp off: {differing}/{compared} log-probs differ, max |diff| {max_abs:.3g}")
    assert differing > 0 and max_abs < 1e-3


@pytest.fixture(scope="module")
def own(model):
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


def test_vllm_own_qwen3_is_the_same_model_and_its_gap_is_reported(own, model):
    requests = random_requests(40, 512, prompts=6, max_len=120)
    with one_thread():
        samples = own.generate(requests, PARAMS)
    assert own.llm.collective_rpc("titan_status")[0]["architecture"] == "Qwen3ForCausalLM"
    differing, max_abs, compared = _gap(model, samples)
    print(
        f"vLLM's own Qwen3 vs the trainer (reported): {differing}/{compared} log-probs differ, max |diff| {max_abs:.3g}"
    )
    assert max_abs < 1e-3  # the same model: float rounding at most, not a wrong weight


def test_weight_sync_is_refused_for_vllm_own_model(own, model):
    with pytest.raises(ValueError, match="implementation='titan'"):
        own.load_weights(model.state_dict(), 1)
