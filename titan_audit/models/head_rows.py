"""The LM head at chosen token rows: logits [N, V] of rows `rows` of x [M, D], the full head's bits.

    logits_NV = head_at_rows(x_MD, weight, rows, link)   # = (x_MD @ weight.T)[rows], bit for bit

Log-probs need the logits of the completion positions only (rl/logprobs.py: about half of a
prompt + completion batch) and a prefill those of each prompt's last position (rl/builtin.py).
At qwen3-0.6b widths (V = 151936) the head is most of a forward, so computing the other rows and
dropping them was most of the work.

Guarantee (batch-invariant mode, a float32 plain-tensor weight with a BI backend): the logits and
every gradient are bitwise those of the full head followed by selecting `rows`:
- forward: mm(x[rows], W.T): a BI gemm row depends on its own row of x only;
- grad_x: +0.0 outside `rows` (what the full head gives there: its gradient rows are +0.0, and a
  fixed-order chain that starts from +0.0 and adds only +-0.0 stays +0.0), mm(grad, W) at `rows`;
- grad_W: mm(G.t(), x) over ALL M rows, G [M, V] the gradient with +0.0 rows outside `rows`: the
  gemm's summation order depends on K = M (the v2 tree's blocks), so the zero rows are kept, not
  skipped. A tied weight hands grad_W to its `TiedLink` (models/tied.py), as the full head does.
So the forward product and grad_x shrink to N rows (two of the head's three gemms); grad_W costs
what it did. `rows` must be distinct (a row's gradient is written, not accumulated).
Elsewhere (native ops, a tensor-parallel DTensor head, a cast weight) the full head runs and the
rows are selected after it (`select_rows`: index_select forward, a zero-filled index_copy
backward, both exact), so the values are the full head's there too.
Log-probs of chosen targets need not even the [N, V] logits: models/chunked_head.py computes them
(and these gradients) in row chunks and vocabulary slices, the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.models import ops, tied


def head_at_rows(
    x_MD: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, link: tied.TiedLink | None
) -> torch.Tensor:
    """(x_MD @ weight.T)[rows] as [N, V] (see the module doc); `link`: the forward's TiedLink
    when the weight is a tied embedding on the linked path, else None."""
    assert x_MD.dim() == 2 and rows.dim() == 1 and rows.dtype == torch.int64, (x_MD.shape, rows.shape, rows.dtype)
    if runs_direct(x_MD, weight):
        return _HeadAtRows.apply(x_MD, weight, rows, link)
    full_MV = tied.head(x_MD, weight, link) if link is not None else ops.linear(x_MD, weight, gather_output=True)
    return select_rows(full_MV, rows)


def runs_direct(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the head at rows runs its own gemms (BI mode, a float32 plain-tensor weight with a
    batch-invariant backend) rather than the full head followed by `select_rows`."""
    if not ops.bi_mode() or isinstance(weight, DTensor) or weight.dtype != torch.float32 or x.dtype != weight.dtype:
        return False
    return tied.has_backend(weight)  # x is on weight's device (the forward's own activations)


class _HeadAtRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MD: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, link) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x_MD, weight, rows)
        ctx.link = link
        return backend_for(x_MD, weight).mm(x_MD.index_select(0, rows), weight.t())

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_NV: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MD, weight, rows = ctx.saved_tensors
        be = backend_for(x_MD, weight)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = x_MD.new_zeros(x_MD.shape)
            grad_x.index_copy_(0, rows, be.mm(grad_NV.contiguous(), weight))
        grad_w = None
        if ctx.needs_input_grad[1] or ctx.link is not None:
            grad_MV = grad_NV.new_zeros((x_MD.shape[0], grad_NV.shape[1]))
            grad_MV.index_copy_(0, rows, grad_NV)
            grad_w = be.mm(grad_MV.t(), x_MD)  # ops.linear's grad_weight: fresh, row-major
        if ctx.link is not None:
            assert ctx.link.head_grad is None, "a tied head's gradient was never taken by its embedding"
            ctx.link.head_grad, grad_w = grad_w, None
        return grad_x, grad_w, None, None


class _SelectRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (rows,) = ctx.saved_tensors
        full = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return full.index_copy_(0, rows, grad), None


def select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] along dim 0, its gradient +0.0 outside `rows` (copied, never added: rows distinct)."""
    return _SelectRows.apply(x, rows)
