"""Log-probs of chosen targets at chosen token rows, through the LM head, in chunks: same bits.

    logprobs_N = logprobs_at_rows(x_MD, weight, rows_N, targets_N, temperature, link)
    # = log_softmax((x_MD @ weight.T)[rows] / temperature)[n, targets[n]], float32 [N]

The RL log-prob recompute (rl/logprobs.py) needs one value per completion token, but the head's
logits and their log-softmax are [N, V] float32 each: 5 GB a tensor at V = 151,936 and N = 8,192.
In batch-invariant mode on the CPU backend (a float32 plain-tensor weight) no [N, V] tensor
exists here: the head, the log-softmax and the gather run in row chunks and vocabulary slices of
about `chunk_bytes` per buffer, and autograd keeps only x, the weight and two floats per row.

Guarantee: the log-probs and the gradients of x and of the weight are bitwise those of the
unchunked path, `token_logprobs(head_at_rows(x, weight, rows, link) / temperature, targets)`
(models/head_rows.py, models/logprobs.py, the division of rl.sampling.scale_logits), whatever
`chunk_bytes`; a tied weight hands its gradient to the `TiedLink` as that path does. Why:
- Forward, by chunks of rows: a BI gemm row depends on its own row of x and the BI log-softmax
  works on one row, so a chunk's rows are the full computation's rows. The logits are computed
  transposed, mm(W, x_c.T): element (v, r) is the same fma chain over k = 0..D-1 as element
  (r, v) of mm(x_c, W.T) (the same K, so the same blocks of the gemm order; an fma is exact in its
  product, so fma(a, b, c) == fma(b, a, c)), and W is never a packed B operand (the packed-weight
  cache would keep a [V, D] copy of it).
- grad_x, by chunks of rows: those rows recomputed, the gather's backward (a one-hot row on +0.0),
  the BI log-softmax backward kernel, autograd's division by the temperature, then
  mm(W.T, G_c.T), the transpose of the unchunked mm(G_c, W) as above; +0.0 outside `rows`.
- grad_W = mm(G_M.T, x) sums over all M token rows in the gemm order's blocks of K = M, so rows
  cannot be cut without holding partial [V, D] sums (one per level of the tree). It is cut along
  the vocabulary instead: row v of grad_W is a BI gemm row of column v of G_M alone, so slice
  [v0, v1) = mm(G_M[:, v0:v1].T, x) over the full K = M is the unchunked gemm's rows. Column v
  of G needs each row's log-softmax at v: the kernel's y = (x - mx) - ls from the logits slice
  mm(W[v0:v1], x_rows.T) and two floats per row saved by the forward: mx = the max logit + 0.0
  (the kernel's max) and ls = -y at the max's position (where y = (mx - mx) - ls: exactly -ls;
  an ls of +0.0 may come back as -0.0, which changes only a zero's sign in y, and exp(+-0) = 1).
  Then the backward kernel on crafted rows: the slice's y and one-hot gradient plus one element
  (y = 0) carrying the target's gradient when the target lies outside the slice. The kernel's
  row sum of a one-hot row on +0.0 is its one value whatever the row's length, so every element
  gets the kernel's fma(-exp(y), s, g) with the full row's s.
Cost: the forward runs the head once, the backward twice more (rows for grad_x, slices for
grad_W) beside its two gemms: five [N, V, D] gemms instead of three. Live tensors: x, the weight,
both gradients, packed copies of x (the gemm's cache) and a few buffers of `chunk_bytes` (and the
gemm kernel packs one chunk-sized operand per call in scratch memory that no tensor holds).
Outside BI mode (native ops, on any device) a plain-tensor head whose [N, V] float32 logits
would exceed one buffer runs in row chunks too (`_NativeChunkedLogprobs`): per chunk the head's
logits, their log-sum-exp and the target's logit; the backward recomputes each chunk's logits and
adds its weight gradient into one [V, D] float32 buffer, chunk after chunk in row order. Native
ops make no bitwise promise: the values are the unchunked path's up to float rounding, and the
same from run to run. Smaller heads (every committed golden's) run the unchunked path as before.
Elsewhere (BI mode on CUDA, a tensor-parallel DTensor head, a cast weight in BI mode) the unchunked
path runs as is: [N, V] logits and log-softmax, no memory bound.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.models import head_rows, ops, tied
from titan_audit.models.logprobs import token_logprobs

CHUNK_BYTES = 64 << 20  # the default size of one row-chunk or vocabulary-slice buffer
_F32 = 4  # bytes of a float32


def logprobs_at_rows(
    x_MD: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    link: tied.TiedLink | None,
    *,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """log_softmax((x_MD @ weight.T)[rows] / temperature)[n, targets[n]] as float32 [N] (module
    doc); `rows` int64 [N] distinct rows of x_MD [M, D]; `link`: the forward's TiedLink when the
    weight is a tied embedding on the linked path, else None; `chunk_bytes`: the size of one
    buffer (None: `CHUNK_BYTES` as it is at the call)."""
    assert x_MD.dim() == 2 and rows.dim() == 1 and rows.dtype == torch.int64, (x_MD.shape, rows.shape, rows.dtype)
    if targets.dim() != 1 or targets.shape != rows.shape or targets.is_floating_point() or targets.dtype == torch.bool:
        shape = tuple(targets.shape)
        raise ValueError(
            f"targets must be a 1-D integer tensor like rows {tuple(rows.shape)}, got {targets.dtype} {shape}"
        )
    vocab = weight.shape[0]
    targets = targets.to(device=x_MD.device, dtype=torch.int64)
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}), got [{int(targets.min())}, {int(targets.max())}]")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if chunked(x_MD, weight):
        return _ChunkedLogprobs.apply(x_MD, weight, rows, targets, float(temperature), link, chunk_bytes)
    if native_chunked(x_MD, weight, rows.numel(), chunk_bytes):
        assert link is None, "a tied link is made in BI mode only"
        return _NativeChunkedLogprobs.apply(x_MD, weight, rows, targets, float(temperature), chunk_bytes)
    logits_NV = head_rows.head_at_rows(x_MD, weight, rows, link)
    return token_logprobs(logits_NV.float() / float(temperature), targets)


def chunked(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `logprobs_at_rows` runs in chunks: BI mode, a float32 plain-tensor weight, the CPU
    backend (whose gemm fixes each output's chain by K alone, so a column slice and a transposed
    product keep the bits)."""
    return head_rows.runs_direct(x, weight) and backend_for(x, weight).NAME == "cpu"


def native_chunked(x: torch.Tensor, weight: torch.Tensor, rows: int, chunk_bytes: int) -> bool:
    """Whether `logprobs_at_rows` runs `_NativeChunkedLogprobs`: outside BI mode, plain tensors,
    and [rows, V] float32 logits larger than one buffer of `chunk_bytes`."""
    plain = not isinstance(weight, DTensor) and not isinstance(x, DTensor)
    return plain and not ops.bi_mode() and rows * weight.shape[0] * _F32 > chunk_bytes


def _scaled_and_log_softmax(be: Any, x_MD: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, temperature: float):  # noqa: ANN202
    """(logits / temperature, their BI log-softmax), float32 [C, V] each, at token rows `rows`."""
    logits_VC = be.mm(weight, x_MD.index_select(0, rows).t())
    scaled_CV = logits_VC.t().contiguous()
    del logits_VC
    scaled_CV.div_(temperature)
    return scaled_CV, be.log_softmax(scaled_CV)


def _row_step(vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (_F32 * max(vocab, 1)))


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MD, weight, rows, targets, temperature, link, chunk_bytes):  # noqa: ANN001, ANN205
        be = backend_for(x_MD, weight)
        n = rows.numel()
        logprobs, mx, ls = (x_MD.new_empty(n) for _ in range(3))
        step = _row_step(weight.shape[0], chunk_bytes)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            scaled_CV, y_CV = _scaled_and_log_softmax(be, x_MD, weight, rows[r0:r1], temperature)
            logprobs[r0:r1] = y_CV.gather(1, targets[r0:r1].unsqueeze(1)).squeeze(1)
            peak = scaled_CV.argmax(1, keepdim=True)
            mx[r0:r1] = scaled_CV.gather(1, peak).squeeze(1) + 0.0
            ls[r0:r1] = -y_CV.gather(1, peak).squeeze(1)
            del scaled_CV, y_CV
        ctx.save_for_backward(x_MD, weight, rows, targets, mx, ls)
        ctx.temperature, ctx.link, ctx.chunk_bytes = temperature, link, chunk_bytes
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MD, weight, rows, targets, mx, ls = ctx.saved_tensors
        grad_N = grad_N.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(x_MD, weight, rows, targets, grad_N, ctx.temperature, ctx.chunk_bytes)
        grad_w = None
        if ctx.needs_input_grad[1] or ctx.link is not None:
            grad_w = _weight_grad(x_MD, weight, rows, targets, grad_N, mx, ls, ctx.temperature, ctx.chunk_bytes)
        if ctx.link is not None:
            assert ctx.link.head_grad is None, "a tied head's gradient was never taken by its embedding"
            ctx.link.head_grad, grad_w = grad_w, None
        return grad_x, grad_w, None, None, None, None, None


def _input_grad(x_MD, weight, rows, targets, grad_N, temperature, chunk_bytes) -> torch.Tensor:  # noqa: ANN001
    """grad_x [M, D]: +0.0 outside `rows`; at them, row chunks of mm(G, W) (module doc)."""
    be = backend_for(x_MD, weight)
    grad_x = x_MD.new_zeros(x_MD.shape)
    n = rows.numel()
    step = _row_step(weight.shape[0], chunk_bytes)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        scaled_CV, y_CV = _scaled_and_log_softmax(be, x_MD, weight, rows[r0:r1], temperature)
        del scaled_CV
        onehot_CV = torch.zeros_like(y_CV).scatter_add_(1, targets[r0:r1].unsqueeze(1), grad_N[r0:r1].unsqueeze(1))
        grad_CV = be.log_softmax_backward(onehot_CV, y_CV)
        del onehot_CV, y_CV
        grad_CV.div_(temperature)
        grad_x.index_copy_(0, rows[r0:r1], be.mm(weight.t(), grad_CV.t()).t())
        del grad_CV
    return grad_x


def _weight_grad(x_MD, weight, rows, targets, grad_N, mx, ls, temperature, chunk_bytes) -> torch.Tensor:  # noqa: ANN001
    """grad_W [V, D] (fresh, row-major): vocabulary slices of mm(G_M.T, x_MD) (module doc)."""
    be = backend_for(x_MD, weight)
    vocab, m, n = weight.shape[0], x_MD.shape[0], rows.numel()
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format)
    x_ND = x_MD.index_select(0, rows)
    step = max(1, chunk_bytes // (_F32 * max(m, 1)))
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        width = v1 - v0
        y_WN = be.mm(weight[v0:v1], x_ND.t())  # the logits' columns v0..v1, transposed
        y_WN.div_(temperature).sub_(mx).sub_(ls)  # the kernel's log-softmax at those columns
        # Crafted rows for the backward kernel: the slice's y and one-hot gradient, and one more
        # element (y = 0) that carries the gradient of a target outside the slice.
        y_ext = x_MD.new_zeros(n, width + 1)
        y_ext[:, :width] = y_WN.t()
        del y_WN
        where = torch.where((targets >= v0) & (targets < v1), targets - v0, width)
        onehot = torch.zeros_like(y_ext).scatter_add_(1, where.unsqueeze(1), grad_N.unsqueeze(1))
        grad_NW = be.log_softmax_backward(onehot, y_ext)[:, :width]
        del onehot, y_ext
        grad_NW.div_(temperature)
        grad_MW = x_MD.new_zeros(m, width)
        grad_MW.index_copy_(0, rows, grad_NW)
        del grad_NW
        grad_w[v0:v1] = be.mm(grad_MW.t(), x_MD)
        del grad_MW
    return grad_w


class _NativeChunkedLogprobs(torch.autograd.Function):
    """Native-ops log-probs in row chunks (module doc): saves x, the weight and one float per row."""

    @staticmethod
    def forward(ctx: Any, x_MD, weight, rows, targets, temperature, chunk_bytes):  # noqa: ANN001, ANN205
        n = rows.numel()
        logprobs, lse = (x_MD.new_empty(n, dtype=torch.float32) for _ in range(2))
        step = _row_step(weight.shape[0], chunk_bytes)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            scaled_CV = _native_scaled(x_MD.index_select(0, rows[r0:r1]), weight, temperature)
            lse[r0:r1] = torch.logsumexp(scaled_CV, 1)
            logprobs[r0:r1] = scaled_CV.gather(1, targets[r0:r1].unsqueeze(1)).squeeze(1) - lse[r0:r1]
            del scaled_CV
        ctx.save_for_backward(x_MD, weight, rows, targets, lse)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_MD, weight, rows, targets, lse = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = x_MD.new_zeros(x_MD.shape) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        n = rows.numel()
        step = _row_step(weight.shape[0], ctx.chunk_bytes)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            # d logp / d scaled = onehot(target) - softmax(scaled); then the division by T
            x_CD = x_MD.index_select(0, rows[r0:r1])
            grad_CV = _native_scaled(x_CD, weight, ctx.temperature)
            grad_CV.sub_(lse[r0:r1].unsqueeze(1)).exp_().mul_(-grad_N[r0:r1].unsqueeze(1))
            grad_CV.scatter_add_(1, targets[r0:r1].unsqueeze(1), grad_N[r0:r1].unsqueeze(1).float())
            grad_CV.div_(ctx.temperature)
            grad_CV = grad_CV.to(weight.dtype)
            if want_x:
                grad_x.index_copy_(0, rows[r0:r1], grad_CV @ weight)
            if want_w and grad_CV.dtype == torch.float32:  # in place: no [V, D] temporary
                grad_w.addmm_(grad_CV.t(), x_CD)
            elif want_w:
                grad_w.add_(grad_CV.t() @ x_CD)
            del grad_CV
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


def _native_scaled(x_CD: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """The head's logits of the hidden rows `x_CD` in float32, divided by the temperature: [C, V]."""
    scaled_CV = torch.nn.functional.linear(x_CD, weight).float()
    return scaled_CV.div_(temperature)
