"""Tied embeddings in batch-invariant mode: the weight's gradient in one [V, D] pass, same bits.

With `tie_word_embeddings` the embedding table is also the LM head. Autograd then builds two dense
[V, D] gradients for it (the head's gemm and the embedding's scatter, mostly +0.0 rows) and adds
them into a third, fresh one: at qwen3-0.6b widths (V = 151936) that is three 620 MB passes and
allocations per microbatch, most of a BI backward. Here the two uses share a `TiedLink` per
forward: the head's backward hands its gradient (a fresh row-major tensor) to the link instead of
to autograd, and the embedding's backward, which runs after it (it needs the gradient of the
first hidden state, which needs the head's), adds its few touched rows into that tensor in place
and returns it as the weight's only gradient.

Guarantee: the weight's gradient is bitwise the one of the untied-autograd path,
head + dense_embedding_grad, elementwise:
- an untouched row is head + (+0.0): the in-place `add_(0.0)` (which turns a -0.0 into +0.0, as
  that add does; every other value is unchanged);
- a touched row is head + rows, where rows is the embedding kernel's fixed-order sum of that
  row's positions (ascending, from +0.0: the backend's `embedding_backward`, `cpu/embedding.py` or
  `gpu/embedding.py`, which share that order), computed on the touched rows only with the same
  per-row order; IEEE addition is commutative, so which of the two autograd would have called
  `old` does not matter;
- a backward that never reaches the head (a loss without the logits) returns the dense
  embedding gradient itself.
The head's input gradient and the forward outputs are `ops.linear`'s / `F.embedding`'s.
Used for float32 weights that are plain tensors (no DTensor, no compute-dtype cast) on a device
with a batch-invariant backend (CPU; CUDA through the Triton kernels); other runs take the plain
path (`applies`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.ops import linear_backward


class TiedLink:
    """One forward's hand-off of the head's weight gradient to the embedding's backward."""

    __slots__ = ("head_grad",)

    def __init__(self) -> None:
        self.head_grad: torch.Tensor | None = None


def applies(weight: torch.Tensor) -> bool:
    """Whether a tied `weight` takes the linked path (see the module doc)."""
    return (
        torch.is_grad_enabled()
        and weight.requires_grad
        and not isinstance(weight, DTensor)
        and weight.dtype == torch.float32
        and has_backend(weight)
    )


def has_backend(weight: torch.Tensor) -> bool:
    """Whether `weight`'s device has a batch-invariant backend (CPU kernels, or CUDA's Triton)."""
    try:
        backend_for(weight)
    except NotImplementedError:
        return False
    return True


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tokens: torch.Tensor, link: TiedLink) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.link, ctx.num_weights = link, weight.shape[0]
        return F.embedding(tokens, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (tokens,) = ctx.saved_tensors
        head, ctx.link.head_grad = ctx.link.head_grad, None
        kernel = backend_for(grad_h, tokens).embedding_backward
        if head is None:
            return kernel(grad_h, tokens, ctx.num_weights), None, None
        touched, position_row = torch.unique(tokens.reshape(-1), return_inverse=True)  # sorted rows
        rows = kernel(grad_h, position_row, int(touched.numel()))  # per row: same order
        head.add_(0.0)  # head + (+0.0) on every row, as the dense add gives the untouched ones
        head[touched] = head[touched] + rows
        return head, None, None


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, link: TiedLink) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.link = link
        return backend_for(h, weight).mm(h, weight.t())

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight = ctx.saved_tensors
        assert ctx.link.head_grad is None, "a tied head's gradient was never taken by its embedding"
        grad_h, ctx.link.head_grad = linear_backward(grad, h, weight)  # ops.linear's: fresh, row-major
        return grad_h, None, None


def embedding(tokens: torch.Tensor, weight: torch.Tensor, link: TiedLink) -> torch.Tensor:
    """F.embedding(tokens, weight), its weight gradient completed by the linked head's."""
    return _Embedding.apply(weight, tokens, link)


def head(h: torch.Tensor, weight: torch.Tensor, link: TiedLink) -> torch.Tensor:
    """h [..., D] @ weight.T (`ops.linear`'s bits), its weight gradient handed to `link`."""
    out = _Head.apply(h.reshape(-1, h.shape[-1]), weight, link)
    return out.reshape(*h.shape[:-1], weight.shape[0])
