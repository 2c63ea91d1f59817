"""vLLM's default multi-process engine (engine-core and worker processes): only our
`vllm.general_plugins` entry point reaches those processes, so a working BI generation there
proves it registers the architecture and installs the BI ops in the worker (outside any
forward), and the zero gap and in-place weight sync hold across the process boundary."""

from __future__ import annotations

import os

import pytest
import torch
from vllm_common import differing, needs_vllm, one_thread, random_requests, tiny

from titan_audit.rl.generator import SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs
from titan_audit.rl.rollouts import trainer_fingerprint

pytestmark = [*needs_vllm, pytest.mark.slow]


def test_multiprocess_engine_plugin_bi_zero_gap_and_sync():
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

    model = tiny("tiny-dense", seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    requests = random_requests(50, 512, prompts=4, max_len=90)
    config = VllmGeneratorConfig(
        batch_invariant=True,
        multiprocessing=True,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=32 << 20,
    )
    with one_thread(), VllmGenerator(model, config) as gen:
        status = gen.llm.collective_rpc("titan_status")[0]
        assert status["pid"] != os.getpid()  # a worker process of vLLM's
        assert status["architecture"] == "TitanForCausalLM" and status["batch_invariant_installed"] is True
        for version in (0, 1):
            if version:
                with torch.no_grad():
                    for t in model.state_dict().values():
                        t.mul_(1.25)
                gen.load_weights(model.state_dict(), version)
            assert gen.weights_fingerprint() == trainer_fingerprint(model.state_dict())
            samples = gen.generate(requests, params)
            trainer = sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples])
            assert [differing(s.logprobs, t) for s, t in zip(samples, trainer)] == [0] * len(samples)
            assert {s.policy_version for s in samples} == {version}
    from titan_audit import batch_invariant

    assert not batch_invariant.is_enabled()  # this process kept its mode
