"""Triton rms_norm forward and backward over the last dim.

Forward, one program per row (BLOCK fixed by N alone), float32 (float64 for float64):
  ss = tl.sum of lanes, lanes[l] += x[c + l] * x[c + l] over chunks c ascending
  rstd = 1 / sqrt(ss / N + eps);  y = (x * rstd) * weight
Backward, grad_x per row (its own program, the same lane order):
  k = rstd^3 * (sum(g * w * x) / N);  grad_x = rstd * (g * w) - x * k
So a row's y, rstd and grad_x depend only on that row and the weight, never on the batch.
grad_weight[j] = sum over rows i of g[i, j] * x[i, j] * rstd[i]: a sum over the batch (so it
depends, as every weight gradient must, on which rows are in it), computed deterministically
without atomics: rows in fixed chunks of ROWS_PER_CHUNK, each chunk's rows added in ascending
order by one program, then the chunk partials added in ascending chunk order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import compute_dtype, interpreted, jit, launch_options, row_block

ROWS_PER_CHUNK = 64
COL_BLOCK = 128


@jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dt = y_ptr.dtype.element_ty
    lanes = tl.full((BLOCK,), -0.0, dtype=dt)
    for c in range(0, n, BLOCK):
        x = tl.load(x_ptr + row * n + c + cols, mask=c + cols < n, other=0.0).to(dt)
        lanes += x * x
    ss = tl.sum(lanes, axis=0)
    rstd = 1.0 / tl.sqrt(ss / n + eps)
    tl.store(rstd_ptr + row, rstd)
    for c in range(0, n, BLOCK):
        m = c + cols < n
        x = tl.load(x_ptr + row * n + c + cols, mask=m, other=0.0).to(dt)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c + cols, mask=m, other=0.0).to(dt)
        tl.store(y_ptr + row * n + c + cols, y, mask=m)


@jit
def _rms_norm_backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, gx_ptr, n, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dt = gx_ptr.dtype.element_ty
    rs = tl.load(rstd_ptr + row)
    lanes = tl.full((BLOCK,), -0.0, dtype=dt)
    for c in range(0, n, BLOCK):
        m = c + cols < n
        g = tl.load(g_ptr + row * n + c + cols, mask=m, other=0.0).to(dt)
        x = tl.load(x_ptr + row * n + c + cols, mask=m, other=0.0).to(dt)
        if HAS_W:
            g = g * tl.load(w_ptr + c + cols, mask=m, other=0.0).to(dt)
        lanes += g * x
    k = ((rs * rs) * rs) * (tl.sum(lanes, axis=0) / n)
    for c in range(0, n, BLOCK):
        m = c + cols < n
        g = tl.load(g_ptr + row * n + c + cols, mask=m, other=0.0).to(dt)
        x = tl.load(x_ptr + row * n + c + cols, mask=m, other=0.0).to(dt)
        if HAS_W:
            g = g * tl.load(w_ptr + c + cols, mask=m, other=0.0).to(dt)
        tl.store(gx_ptr + row * n + c + cols, rs * g - x * k, mask=m)


@jit
def _weight_grad_chunks_kernel(g_ptr, x_ptr, rstd_ptr, part_ptr, m, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    chunk = tl.program_id(1)
    dt = part_ptr.dtype.element_ty
    acc = tl.full((BLOCK,), -0.0, dtype=dt)
    r0 = chunk * ROWS
    r1 = tl.minimum(r0 + ROWS, m)
    off = r0.to(tl.int64) * n
    for r in range(r0, r1):  # rows of the chunk, ascending
        g = tl.load(g_ptr + off + cols, mask=cols < n, other=0.0).to(dt)
        x = tl.load(x_ptr + off + cols, mask=cols < n, other=0.0).to(dt)
        rs = tl.load(rstd_ptr + r)
        acc += (g * x) * rs
        off += n
    tl.store(part_ptr + chunk.to(tl.int64) * n + cols, acc, mask=cols < n)


@jit
def _chunk_sum_kernel(part_ptr, out_ptr, chunks, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), -0.0, dtype=out_ptr.dtype.element_ty)
    for c in range(0, chunks):  # chunk partials, ascending
        acc += tl.load(part_ptr + c * n + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr + cols, acc, mask=cols < n)


def _shape(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd [..., 1]) in compute dtype."""
    dtype = compute_dtype(x.dtype)
    xc = x.contiguous()
    w = None if weight is None else weight.contiguous()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=dtype, device=x.device)
    m, n = _shape(x)
    if m and n:
        block, warps = row_block(n, x)
        _rms_norm_kernel[(m,)](
            xc,
            w if w is not None else xc,
            y,
            rstd,
            n,
            float(eps),
            HAS_W=w is not None,
            BLOCK=block,
            **launch_options(x, warps),
        )
    return y, rstd


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x, grad_weight) in compute dtype."""
    dtype = rstd.dtype
    g, xc, rs = grad.to(dtype).contiguous(), x.to(dtype).contiguous(), rstd.to(dtype).contiguous()
    w = None if weight is None else weight.contiguous()
    m, n = _shape(x)
    gx = torch.empty(x.shape, dtype=dtype, device=x.device)
    gw = None if w is None else torch.zeros(n, dtype=dtype, device=x.device)
    if not (m and n):
        return gx, gw
    block, warps = row_block(n, x)
    opts = launch_options(x, warps)
    _rms_norm_backward_kernel[(m,)](
        g, xc, w if w is not None else xc, rs, gx, n, HAS_W=w is not None, BLOCK=block, **opts
    )
    if gw is not None:
        chunks = triton.cdiv(m, ROWS_PER_CHUNK)
        col_block = 32 if interpreted(x) else COL_BLOCK
        part = torch.empty((chunks, n), dtype=dtype, device=x.device)
        grid = (triton.cdiv(n, col_block), chunks)
        _weight_grad_chunks_kernel[grid](
            g, xc, rs, part, m, n, ROWS=ROWS_PER_CHUNK, BLOCK=col_block, **launch_options(x, 4)
        )
        _chunk_sum_kernel[(triton.cdiv(n, col_block),)](part, gw, chunks, n, BLOCK=col_block, **launch_options(x, 4))
    return gx, gw
