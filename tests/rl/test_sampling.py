"""Keyed sampling (rl/sampling.py): the uniform is the documented pure function of (key, position);
the draw of a row does not depend on the other rows (BI mode) and respects top-k / top-p exactly,
ties broken by token id; the inverse-CDF draw hits each kept token in proportion to its mass."""

import hashlib
import struct

import numpy as np
import pytest
import torch

from titan_audit import batch_invariant as bi
from titan_audit.rl.generator import SampleKey, SamplingParams
from titan_audit.rl.sampling import sample_rows, sample_uniform, scale_logits, stream_key


def _documented_uniform(seed, step, prompt_id, sample_index, position):
    key = hashlib.blake2b(
        struct.pack("<QqQQ", seed, step, prompt_id, sample_index), digest_size=16, person=b"titan-audit/smp1"
    ).digest()
    word = hashlib.blake2b(struct.pack("<Q", position), digest_size=8, key=key).digest()
    return (int.from_bytes(word, "little") >> 11) / 2**53


def test_uniform_is_the_documented_function_of_key_and_position():
    for fields in [(0, 0, 0, 0), (7, -3, 12, 5), (2**64 - 1, 2**63 - 1, 2**64 - 1, 2**64 - 1)]:
        key = SampleKey(*fields)
        for position in (0, 1, 1000):
            u = sample_uniform(key, position)
            assert u == _documented_uniform(*fields, position)
            assert 0.0 <= u < 1.0


def test_uniform_changes_with_every_key_field_and_the_position():
    base = SampleKey(1, 2, 3, 4)
    u = sample_uniform(base, 5)
    others = [SampleKey(9, 2, 3, 4), SampleKey(1, 9, 3, 4), SampleKey(1, 2, 9, 4), SampleKey(1, 2, 3, 9)]
    assert all(sample_uniform(k, 5) != u for k in others)
    assert sample_uniform(base, 6) != u
    assert sample_uniform(SampleKey(1, 2, 3, 4), 5) == u  # reproducible
    # the fields are not interchangeable (no symmetric mixing)
    assert sample_uniform(SampleKey(1, 2, 4, 3), 5) != u


@pytest.mark.parametrize(
    "bad", [SampleKey(-1, 0, 0, 0), SampleKey(0, 0, -1, 0), SampleKey(0, 0, 0, 2**64), SampleKey(0, 2**63, 0, 0)]
)
def test_bad_key_fields_are_value_errors(bad):
    with pytest.raises(ValueError, match="sample key"):
        stream_key(bad)


PARAMS = [
    SamplingParams(),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(top_k=20, top_p=0.8),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"k{p.top_k}-p{p.top_p}")
def test_a_rows_draw_is_the_same_alone_and_in_any_batch(params):
    g = torch.Generator().manual_seed(0)
    rows_BV = scale_logits(torch.randn(33, 301, generator=g) * 3, 0.7)
    uniforms = [sample_uniform(SampleKey(0, 0, i, 0), 0) for i in range(33)]
    with bi.enabled():
        together = sample_rows(rows_BV, uniforms, params)
        alone = torch.stack([sample_rows(rows_BV[i : i + 1], uniforms[i : i + 1], params)[0] for i in range(33)])
        perm = torch.randperm(33, generator=g)
        shuffled = sample_rows(rows_BV[perm], [uniforms[i] for i in perm], params)
    assert torch.equal(together, alone)
    assert torch.equal(shuffled, together[perm])
    # negative control: the draw does depend on the uniform (the check above can fail)
    with bi.enabled():
        moved = sample_rows(rows_BV, [(u + 0.5) % 1.0 for u in uniforms], params)
    assert not torch.equal(moved, together)


def _kept_set(row: np.ndarray, top_k: int, top_p: float) -> tuple[list[int], np.ndarray]:
    """Independent reference: the kept tokens in order and their renormalised float64 probs."""
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))  # descending, ties by id
    p = np.exp(row.astype(np.float64) - row.max())
    p /= p.sum()
    kept = order[:top_k] if top_k else order
    q = p[kept] / p[kept].sum()
    if top_p < 1.0:
        cum = np.cumsum(q)
        n = int(np.searchsorted(cum, top_p, side="left")) + 1
        kept = kept[:n]
        q = q[:n] / q[:n].sum()
    return kept, q


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (7, 1.0), (0, 0.5), (12, 0.7), (1, 1.0)])
def test_draws_follow_the_truncated_distribution(top_k, top_p):
    """A grid of N uniforms u_i = (i + 0.5) / N: inverse-CDF sampling hits every kept token about
    N * q times (within the grid's +-1, plus float rounding slack) and never anything else."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 64, 4000
    row_V = scale_logits(torch.randn(vocab, generator=g) * 2, 0.9)
    params = SamplingParams(top_k=top_k, top_p=top_p)
    uniforms = [(i + 0.5) / n for i in range(n)]
    with bi.enabled():
        tokens = sample_rows(row_V.expand(n, vocab), uniforms, params).numpy()
    kept, q = _kept_set(row_V.numpy(), top_k, top_p)
    assert set(tokens.tolist()) <= set(kept)
    counts = np.bincount(tokens, minlength=vocab)[kept]
    assert np.all(np.abs(counts - n * q) <= 2.5), (counts, n * q)


def test_top_k_ties_keep_the_lower_token_ids():
    row_V = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.5])  # four-way tie at the top
    uniforms = [(i + 0.5) / 100 for i in range(100)]
    tokens = sample_rows(row_V.expand(100, 6), uniforms, SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {1, 2}
    tokens = sample_rows(row_V.expand(100, 6), uniforms, SamplingParams(top_k=5))
    assert set(tokens.tolist()) == {1, 2, 3, 4, 5}


def test_top_p_keeps_the_token_that_crosses_p_and_at_least_one():
    # probs 0.5, 0.3, 0.2 (as logits): p = 0.6 keeps the first two, p tiny keeps the top one
    row_V = torch.tensor([0.3, 0.5, 0.2]).log()
    uniforms = [(i + 0.5) / 200 for i in range(200)]
    assert set(sample_rows(row_V.expand(200, 3), uniforms, SamplingParams(top_p=0.6)).tolist()) == {1, 0}
    assert set(sample_rows(row_V.expand(200, 3), uniforms, SamplingParams(top_p=1e-9)).tolist()) == {1}


def test_zero_probability_tokens_are_never_drawn():
    row_V = torch.tensor([0.0, -1e30, 0.0, -1e30, -1e30])  # tokens 1, 3, 4 have probability 0
    uniforms = [0.0, 0.25, 0.5, 0.75, 1.0 - 2**-53]
    for params in (SamplingParams(), SamplingParams(top_k=4)):
        tokens = sample_rows(row_V.expand(5, 5), uniforms, params).tolist()
        assert set(tokens) <= {0, 2} and 0 in tokens and 2 in tokens
