"""Triton sum over the last dim: a row's sum in an order fixed by the row length alone.

Order for a row of length N (BLOCK = `row_block(N)`: a power of two fixed by N):
  lanes[l] = -0.0 ...; for c in 0, BLOCK, 2*BLOCK, ... (ascending): lanes[l] += x[c + l]  (masked: skip)
  sum = tl.sum(lanes)  (Triton's reduction tree over BLOCK lanes: fixed by BLOCK and the warp count)
One program per row, so no row ever shares arithmetic with another: the bits of a row's sum do
not depend on how many rows are summed together. Accumulation in float32 (float64 for float64).
`sum_dims` moves the summed dims last (a copy when needed) and sums the flattened rows.
"""

from __future__ import annotations

import torch
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import compute_dtype, jit, launch_options, row_block


@jit
def _row_sum_kernel(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    lanes = tl.full((BLOCK,), -0.0, dtype=out_ptr.dtype.element_ty)
    for c in range(0, n, BLOCK):
        x = tl.load(x_ptr + row * stride + c + cols, mask=c + cols < n, other=-0.0)
        lanes += x.to(lanes.dtype)
    tl.store(out_ptr + row, tl.sum(lanes, axis=0))


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (dropped), in compute dtype."""
    dtype = compute_dtype(x.dtype)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n = x2.shape
    out = torch.zeros(m, dtype=dtype, device=x.device)
    if m and n:
        block, warps = row_block(n, x)
        _row_sum_kernel[(m,)](x2, out, n, x2.stride(0), BLOCK=block, **launch_options(x, warps))
    return out.reshape(x.shape[:-1]) if x.dim() else out.reshape(())


def sum_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Sum over `dims` (normalised, distinct), flattened in row-major order, by `tree_sum`."""
    dims = sorted(dims)
    if x.dim() == 0:
        return tree_sum(x.reshape(1)).reshape(())
    rest = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*rest, *dims)
    out = tree_sum(moved.reshape(*moved.shape[: len(rest)], -1))
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out
