"""The model reads its paged KV cache in place (`PagedKeys` -> `ops.paged_attention`), with the bits
of the dense gather it replaced.

- BI mode: the built-in generator's samples (tokens and log-probs, bitwise) with the paged kernel
  reading every layer's keys through the block table equal those of the same generator with each
  paged read replaced by the dense path (`keys.gather()` then `ops.attention`: what the cache did
  before), for prompts of 3, 70 and 150 tokens (a row past one 128-key chunk, positions off the
  block boundaries), GQA, n = 2 samples of one prompt (forked blocks), block sizes 4 and 16; the
  paged kernel did run (calls counted), the dense path did not. Negative control (constructed):
  the paged read with blocks 0 and 1 of each long row swapped in its table changes the log-probs.
- Autograd: a cached forward that autograd records gathers (the paged kernel is forward-only)
  and gives the same logits, bitwise; native mode gathers too and never calls the paged kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_audit import batch_invariant, models
from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant import cpu
from titan_audit.models import ops
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams

from .conftest import SMALL_DENSE

PARAMS = SamplingParams(temperature=0.8, max_new_tokens=6)
PROMPT_LENGTHS = (3, 70, 150)


@pytest.fixture(scope="module")
def model() -> models.Transformer:
    return models.build(SMALL_DENSE, seed=1).eval()


def _requests() -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(5)
    out = []
    for prompt_id, n in enumerate(PROMPT_LENGTHS):
        prompt = tuple(torch.randint(0, SMALL_DENSE.vocab_size, (n,), generator=g).tolist())
        for sample_index in range(2 if n == 70 else 1):
            out.append(
                GenerationRequest(prompt, SampleKey(seed=2, step=0, prompt_id=prompt_id, sample_index=sample_index))
            )
    return out


def _dense_read(q_BHTD, keys, q_pos_BT):  # noqa: ANN001, ANN202
    """What the paged cache did before: one dense copy of the rows' blocks, then BI attention."""
    return ops.attention(q_BHTD, *keys.gather(), q_pos_BT)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = []
    kernel = cpu.paged_attention

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu, "paged_attention", counted)
    return calls


def _generate(model: models.Transformer, block_size: int) -> dict:
    gen = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, block_size=block_size))
    return {s.key: s for s in gen.generate(_requests(), PARAMS)}


@pytest.mark.parametrize("block_size", [4, 16])
def test_generator_samples_equal_the_dense_gather_path_bitwise(model, block_size, monkeypatch) -> None:
    calls = _counting(monkeypatch)
    paged = _generate(model, block_size)
    assert len(calls) > 0
    with monkeypatch.context() as m:
        m.setattr(ops, "_bi_paged_attention", _dense_read)
        calls.clear()
        dense = _generate(model, block_size)
        assert calls == []
    assert paged.keys() == dense.keys()
    for key, sample in paged.items():
        assert sample.tokens == dense[key].tokens, key
        assert bitwise_equal(sample.logprobs, dense[key].logprobs), key


@pytest.mark.control
def test_negative_control_two_blocks_swapped_in_the_paged_read_change_the_logprobs(model, monkeypatch) -> None:
    block_size = 16
    reference = _generate(model, block_size)
    kernel = ops._bi_paged_attention

    def swapped(q_BHTD, keys, q_pos_BT):  # noqa: ANN001, ANN202
        table = keys.table_BN.clone()
        long_rows = keys.seq_lens_B > 2 * block_size  # rows holding blocks 0 and 1 in full
        if bool(long_rows.any()):
            table[long_rows, 0], table[long_rows, 1] = keys.table_BN[long_rows, 1], keys.table_BN[long_rows, 0]
        return kernel(q_BHTD, dataclasses.replace(keys, table_BN=table), q_pos_BT)

    monkeypatch.setattr(ops, "_bi_paged_attention", swapped)
    other = _generate(model, block_size)
    changed = [key for key, s in other.items() if not bitwise_equal(s.logprobs, reference[key].logprobs)]
    assert sorted(k.prompt_id for k in changed) == [1, 1, 2]  # the rows longer than two blocks


def test_recorded_and_native_forwards_gather(model, monkeypatch) -> None:
    """With autograd recording the cached forward takes the dense path (same logits, bitwise, as
    the paged kernel's under no_grad); native mode never calls the paged kernel."""
    calls = _counting(monkeypatch)
    tokens = torch.randint(0, SMALL_DENSE.vocab_size, (2, 140), generator=torch.Generator().manual_seed(3))

    def cached_logits(grad: bool) -> torch.Tensor:
        cache = models.PagedKVCache(SMALL_DENSE, num_blocks=40, block_size=8)
        for seq in (0, 1):
            cache.add(seq)
        with torch.set_grad_enabled(grad):
            model(tokens[:, :131], cache=cache.batch([0, 1]))
            return model(tokens[:, 131:], cache=cache.batch([0, 1]))

    with batch_invariant.enabled():
        paged = cached_logits(grad=False)
        assert len(calls) == 2 * SMALL_DENSE.num_hidden_layers
        calls.clear()
        recorded = cached_logits(grad=True)
        assert recorded.requires_grad and calls == []
    assert bitwise_equal(recorded.detach(), paged)
    with torch.no_grad():
        native = cached_logits(grad=False)
    assert calls == [] and native.shape == paged.shape
