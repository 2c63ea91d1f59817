"""The Triton embedding weight gradient compiled on a real GPU (marker `gpu`, skipped without CUDA;
run by scripts/gpu_check.sh): the interpreter tests' properties (test_triton_embedding.py) at a
Qwen3-like width, bitwise.

The CUDA kernel's bits are the CPU kernel's (float32 adds in the same order, no fma to contract):
with repeated tokens, padding_idx, untouched rows and a bfloat16 grad; the D block width never
changes them; BI mode routes CUDA F.embedding's backward to it; the tied path (models/tied.py)
on CUDA equals the plain path on CUDA. Negative control: the rows in another order (the same
kernel over a shuffled batch: each token's rows added in the shuffled order) give other bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu.embedding import embedding_backward as cpu_embedding_backward

pytestmark = pytest.mark.gpu
DEV = "cuda"
V, D, N = 32768, 1024, 8192


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = (torch.rand(N, generator=g) ** 4 * (V // 8)).long()  # skewed: a few rows with many positions
    scale = 10.0 ** (3 * torch.randint(-1, 2, (N, 1), generator=g)).float()
    grad = torch.randn(N, D, generator=g) * scale
    return grad, tokens


def test_gpu_embedding_backward_has_the_cpu_kernels_bits() -> None:
    from titan_audit.batch_invariant.gpu.embedding import embedding_backward, segment_sum

    grad, tokens = _inputs(0)
    for padding_idx in (0, -1):
        want = cpu_embedding_backward(grad, tokens, V, padding_idx)
        got = embedding_backward(grad.to(DEV), tokens.to(DEV), V, padding_idx)
        assert_bitwise_equal(got.cpu(), want, f"padding_idx {padding_idx}")
    for block_d in (128, 256):  # want: padding_idx -1
        assert_bitwise_equal(segment_sum(grad.to(DEV), tokens.to(DEV), V, block_d=block_d).cpu(), want)
    half = grad.bfloat16()
    assert_bitwise_equal(
        embedding_backward(half.to(DEV), tokens.to(DEV), V).cpu(), cpu_embedding_backward(half, tokens, V)
    )
    shuffled = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    other_order = embedding_backward(grad[shuffled].to(DEV), tokens[shuffled].to(DEV), V)
    assert not bitwise_equal(other_order.cpu(), want)


def test_gpu_mode_routes_embedding_backward_and_the_tied_path() -> None:
    from titan_audit.models import tied

    grad, tokens = _inputs(2)
    weight = torch.zeros(V, D, device=DEV, requires_grad=True)
    with bi.enabled():
        F.embedding(tokens.to(DEV), weight, padding_idx=5).backward(grad.to(DEV))
    assert_bitwise_equal(weight.grad.cpu(), cpu_embedding_backward(grad, tokens, V, 5))

    w0 = torch.randn(4096, 256, device=DEV)
    toks = tokens[:512].reshape(2, 256).to(DEV)
    h = torch.randn(2, 256, 256, device=DEV)
    upstream = torch.randn(2, 256, 4096, device=DEV)
    grads = []
    for linked in (True, False):
        w = w0.clone().requires_grad_()
        with bi.enabled():
            assert tied.applies(w)
            link = tied.TiedLink()
            emb = tied.embedding(toks, w, link) if linked else F.embedding(toks, w)
            x = h + emb
            logits = tied.head(x, w, link) if linked else bi.linear(x, w)
            (logits * upstream).sum().backward()
        grads.append(w.grad)
    assert_bitwise_equal(grads[0], grads[1])
