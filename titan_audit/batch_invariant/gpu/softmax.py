"""Triton softmax / log_softmax over the last dim and their backward, one program per row.

Order for a row of length N (BLOCK fixed by N alone, `row_block`), all in float32 (float64 for
float64 inputs):
  max = tl.max of the lane-wise max over chunks (exact: a max does not round)
  sum = tl.sum of lanes, lanes[l] += exp(x[c + l] - max) over chunks c ascending
  softmax = exp(x - max) / sum;  log_softmax = (x - max) - log(sum)
Backward: softmax: y * (g - dot), dot = lane sum of g * y; log_softmax: g - exp(y) * sum(g).
A row is computed by its own program from its own elements only, so its bits do not depend on the
number of rows (the batch) or on their order.
"""

from __future__ import annotations

import torch
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import compute_dtype, jit, launch_options, row_block


@jit
def _softmax_kernel(x_ptr, y_ptr, n, stride, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dt = y_ptr.dtype.element_ty
    x_row = x_ptr + row * stride
    y_row = y_ptr + row * stride
    lanes_max = tl.full((BLOCK,), float("-inf"), dtype=dt)
    for c in range(0, n, BLOCK):
        x = tl.load(x_row + c + cols, mask=c + cols < n, other=float("-inf")).to(dt)
        lanes_max = tl.maximum(lanes_max, x)
    mx = tl.max(lanes_max, axis=0)
    lanes = tl.zeros((BLOCK,), dtype=dt)
    for c in range(0, n, BLOCK):
        x = tl.load(x_row + c + cols, mask=c + cols < n, other=float("-inf")).to(dt)
        lanes += tl.where(c + cols < n, tl.exp(x - mx), 0.0)
    total = tl.sum(lanes, axis=0)
    log_total = tl.log(total)
    for c in range(0, n, BLOCK):
        x = tl.load(x_row + c + cols, mask=c + cols < n, other=0.0).to(dt)
        if LOG:
            y = (x - mx) - log_total
        else:
            y = tl.exp(x - mx) / total
        tl.store(y_row + c + cols, y, mask=c + cols < n)


@jit
def _softmax_backward_kernel(g_ptr, y_ptr, out_ptr, n, stride, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dt = out_ptr.dtype.element_ty
    lanes = tl.zeros((BLOCK,), dtype=dt)
    for c in range(0, n, BLOCK):
        m = c + cols < n
        g = tl.load(g_ptr + row * stride + c + cols, mask=m, other=0.0).to(dt)
        if LOG:
            lanes += g
        else:
            y = tl.load(y_ptr + row * stride + c + cols, mask=m, other=0.0).to(dt)
            lanes += g * y
    total = tl.sum(lanes, axis=0)
    for c in range(0, n, BLOCK):
        m = c + cols < n
        g = tl.load(g_ptr + row * stride + c + cols, mask=m, other=0.0).to(dt)
        y = tl.load(y_ptr + row * stride + c + cols, mask=m, other=0.0).to(dt)
        if LOG:
            out = g - tl.exp(y) * total
        else:
            out = y * (g - total)
        tl.store(out_ptr + row * stride + c + cols, out, mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous()


def _forward(x: torch.Tensor, log: bool) -> torch.Tensor:
    dtype = compute_dtype(x.dtype)
    xc = _rows(x)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.shape[-1] if x.dim() else 1
    m = x.numel() // n if n else 0
    if m and n:
        block, warps = row_block(n, x)
        _softmax_kernel[(m,)](xc, y, n, n, LOG=log, BLOCK=block, **launch_options(x, warps))
    return y


def _backward(grad: torch.Tensor, y: torch.Tensor, log: bool) -> torch.Tensor:
    dtype = compute_dtype(y.dtype)
    if grad.shape != y.shape:
        raise ValueError(f"softmax backward: grad {tuple(grad.shape)} and output {tuple(y.shape)} must have one shape")
    g, yc = _rows(grad.to(dtype)), _rows(y.to(dtype))
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    n = y.shape[-1] if y.dim() else 1
    m = y.numel() // n if n else 0
    if m and n:
        block, warps = row_block(n, y)
        _softmax_backward_kernel[(m,)](g, yc, out, n, n, LOG=log, BLOCK=block, **launch_options(y, warps))
    return out


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _forward(x, log=False)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _forward(x, log=True)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _backward(grad, y, log=False)


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _backward(grad, y, log=True)
