"""Batch-invariant softmax attention: a key-chunked, position-aligned reduction order, with an
autograd Function over the backend's forward and backward kernels.

Guarantees: a query row (b, h, i) of the output is bitwise independent of the batch size, the
number of queries and keys computed together and of invisible keys (masked by causality, another
document or padding); the backward is deterministic (fixed order, fixed shapes). Bad shapes,
dtypes or positions are a ValueError naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.inputs import check_float, check_same_dtype, needs_autograd


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        q_positions: torch.Tensor,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        out, lse = backend_for(q, k, v).attention_forward(q, k, v, scale, causal, q_positions, doc_ids)
        ctx.save_for_backward(q, k, v, out, lse, q_positions, doc_ids)
        ctx.scale, ctx.causal = scale, causal
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, q_positions, doc_ids = ctx.saved_tensors
        dq, dk, dv = backend_for(q, k, v).attention_backward(
            grad, q, k, v, out, lse, ctx.scale, ctx.causal, q_positions, doc_ids
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _positions(q_positions: torch.Tensor | None, batch: int, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """The query positions [B, Tq] (long) on the device of q (no host-device copy on CUDA)."""
    if q_positions is None:
        return torch.arange(tk - tq, tk, device=device).expand(batch, tq)
    if not isinstance(q_positions, torch.Tensor) or q_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError("q_positions must be an integer (long) tensor of shape [Tq] or [B, Tq]")
    if q_positions.shape not in (torch.Size([tq]), torch.Size([batch, tq])):
        raise ValueError(f"q_positions must have shape [{tq}] or [{batch}, {tq}], got {tuple(q_positions.shape)}")
    if q_positions.numel() and int(q_positions.min()) < 0:
        raise ValueError("q_positions must be >= 0")
    return q_positions.long().to(device).expand(batch, tq)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_positions: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with a key-chunked, position-aligned reduction order.

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] with Hq % Hkv == 0 (query head h uses kv head
    h // (Hq // Hkv)). Key j sits at absolute position j. `q_positions` (None: the last Tq
    positions, Tk - Tq + i) is a LongTensor [Tq] or [B, Tq]. causal: key j visible iff
    j <= position. `doc_ids` [B, Tk]: a query sees only keys of its own document; ids < 0 are
    padding keys, never visible. A query with no visible key gets zeros. Output [B, Hq, Tq, D]
    in q's dtype; its row (b, h, i) is bitwise independent of B, Tq, Tk and invisible keys.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D [B, H, T, D], got {tuple(t.shape)}")
    check_same_dtype(q=q, k=k, v=v)
    batch, hq, tq, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(
            f"attention: expected k and v [B={batch}, Hkv, Tk, D={dim}], got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    hkv, tk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q_positions is None and tq > tk:
        raise ValueError(f"attention: Tq={tq} > Tk={tk} needs explicit q_positions")
    positions = _positions(q_positions, batch, tq, tk, q.device)
    if doc_ids is not None:
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("doc_ids must be an integer (long) tensor of shape [B, Tk]")
        if tuple(doc_ids.shape) != (batch, tk):
            raise ValueError(f"doc_ids must have shape [{batch}, {tk}], got {tuple(doc_ids.shape)}")
        if positions.numel() and int(positions.max()) >= tk:
            raise ValueError(f"attention: with doc_ids every query position must be < Tk={tk}")
        doc_ids = doc_ids.long()
    if scale is None:
        scale = dim**-0.5
    if not needs_autograd(q, k, v):  # the same forward kernel without the Function's bookkeeping
        out, _ = backend_for(q, k, v).attention_forward(
            q, k, v, float(scale), bool(causal), positions.contiguous(), doc_ids
        )
        return out.to(q.dtype)
    return _Attention.apply(q, k, v, float(scale), bool(causal), positions.contiguous(), doc_ids)
