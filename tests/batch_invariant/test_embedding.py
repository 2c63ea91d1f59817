"""The embedding's weight gradient on our kernel (batch_invariant/cpu/embedding.py), which BI mode
puts under aten::embedding_dense_backward.

Checked bitwise: each row is the grad rows of its token added one by one in ascending position
from +0.0 (the documented order), rows of padding_idx add nothing, every ISA variant and thread
count gives those bits, and autograd through F.embedding in BI mode returns them. Negative
control: the same rows added in the reverse order differ, so the order is what is checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_audit import batch_invariant as bi
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu.embedding import embedding_backward

V, D, N = 50, 37, 400


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, V, N))
    scale = (10.0 ** (3 * rng.integers(-1, 2, (N, 1)))).astype(np.float32)  # rows of very different size
    grad = torch.from_numpy(rng.standard_normal((N, D)).astype(np.float32) * scale)
    return grad, tokens


def _sequential(grad: torch.Tensor, tokens: torch.Tensor, order, padding_idx: int = -1) -> torch.Tensor:
    out = torch.zeros(V, D)
    for i in order:
        if int(tokens[i]) != padding_idx:
            out[tokens[i]] = out[tokens[i]] + grad[i]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_rows_are_added_in_ascending_position(padding_idx):
    grad, tokens = _inputs()
    want = _sequential(grad, tokens, range(N), padding_idx)
    assert torch.equal(bits(embedding_backward(grad, tokens, V, padding_idx)), bits(want))


@pytest.mark.control
def test_negative_control_another_order_gives_other_bits():
    grad, tokens = _inputs()
    assert not torch.equal(
        bits(embedding_backward(grad, tokens, V)), bits(_sequential(grad, tokens, reversed(range(N))))
    )


def test_every_variant_and_thread_count_gives_the_same_bits(monkeypatch):
    grad, tokens = _inputs()
    want = embedding_backward(grad, tokens, V)
    monkeypatch.setattr(_lib, "num_threads", lambda: 2)
    big_grad, big_tokens = grad.repeat(100, 1), tokens.repeat(100)  # over the threading threshold
    reference = embedding_backward(big_grad, big_tokens, V)
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            assert torch.equal(bits(embedding_backward(grad, tokens, V)), bits(want)), isa
            assert torch.equal(bits(embedding_backward(big_grad, big_tokens, V)), bits(reference)), isa


def test_bi_mode_autograd_uses_the_kernel():
    grad, tokens = _inputs()
    weight = torch.zeros(V, D, requires_grad=True)
    with bi.enabled():
        F.embedding(tokens, weight).backward(grad)
    assert torch.equal(bits(weight.grad), bits(embedding_backward(grad, tokens, V)))
