"""Triton embedding weight gradient (aten::embedding_dense_backward) in the CPU kernel's order.

Guarantee: `embedding_backward(grad, indices, num_weights, padding_idx)` returns [V, D] float32
where row v is the sum of the grad rows whose index is v, added one by one in ascending position
from +0.0 (rows of `padding_idx` or out of [0, V) add nothing; rows never touched are +0.0): the
contract of `cpu/embedding.py` (`cpu/kernels/embedding.cpp`), element for element. Inputs of
other floating dtypes are upcast exactly to float32; the caller rounds the result once.

How: on the host, with exact integer torch ops, the positions that add something are stably
sorted by their index (so each index's positions stay ascending) and cut into one segment per
touched row. Then one program per (segment, block of D columns) loads the segment's grad rows in
ascending position and adds them into a float32 accumulator that starts at +0.0, and stores the
row once. No atomics and no split of a row's sum: every output element is one chain of IEEE adds
in ascending position, whatever the block width, the number or the scheduling of programs, or
the other rows in the batch (columns never meet, so the block width shapes no bits).

Why batch-invariant: a row's gradient depends only on the grad rows that carry its index and on
their relative order, not on how the batch is tiled or which programs run beside it. In Triton's
interpreter (CPU tensors, tests) the bits equal the CPU kernel's: the same float32 adds in the same
order (tests/batch_invariant/test_triton_embedding.py). On a GPU they are expected to be the same
too (plain float32 adds, `enable_fp_fusion=False`, nothing to contract), not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import check_device, interpreted, jit, launch_options


@jit
def _embedding_backward_kernel(grad_ptr, pos_ptr, row_ptr, start_ptr, end_ptr, out_ptr, d, BLOCK_D: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    start = tl.load(start_ptr + seg)
    end = tl.load(end_ptr + seg)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)  # +0.0, as the CPU kernel starts
    for i in range(start, end):  # the segment's positions, ascending
        p = tl.load(pos_ptr + i)
        acc = acc + tl.load(grad_ptr + p * d + cols, mask=mask, other=0.0)
    row = tl.load(row_ptr + seg)
    tl.store(out_ptr + row * d + cols, acc, mask=mask)


def _block_d(d: int, t: torch.Tensor) -> int:
    cap = 64 if interpreted(t) else 1024
    return min(cap, triton.next_power_of_2(max(d, 1)))


def embedding_backward(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1
) -> torch.Tensor:
    """grad [..., D] of the looked-up rows, indices [...] (integers) -> float32 [num_weights, D]."""
    return segment_sum(grad, indices, num_weights, padding_idx)


def segment_sum(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1, *, block_d: int | None = None
) -> torch.Tensor:
    """`embedding_backward` with the D block width as a knob (a power of two; None: chosen by D
    alone). The width changes the programs' tiling, never the bits (module doc)."""
    check_device(grad, indices)
    dim = grad.shape[-1]
    flat_grad = grad.reshape(-1, dim).to(torch.float32).contiguous()
    flat_idx = indices.reshape(-1).to(torch.int64).contiguous()
    if flat_idx.numel() != flat_grad.shape[0]:
        raise ValueError(f"embedding_backward: {flat_idx.numel()} indices for {flat_grad.shape[0]} grad rows")
    out = torch.zeros((num_weights, dim), dtype=torch.float32, device=grad.device)
    adds = (flat_idx >= 0) & (flat_idx < num_weights) & (flat_idx != padding_idx)
    positions = torch.nonzero(adds).reshape(-1)  # ascending
    keys, order = torch.sort(flat_idx[positions], stable=True)  # ties keep ascending position
    positions = positions[order].contiguous()
    rows, counts = torch.unique_consecutive(keys, return_counts=True)
    if rows.numel() == 0 or dim == 0:
        return out
    ends = torch.cumsum(counts, 0)
    starts = (ends - counts).contiguous()
    block = block_d if block_d is not None else _block_d(dim, grad)
    if block <= 0 or block & (block - 1):
        raise ValueError(f"embedding_backward: block_d {block} is not a power of two")
    grid = (rows.numel(), triton.cdiv(dim, block))
    _embedding_backward_kernel[grid](
        flat_grad,
        positions,
        rows.contiguous(),
        starts,
        ends.contiguous(),
        out,
        dim,
        BLOCK_D=block,
        **launch_options(grad, max(1, min(4, block // 256))),
    )
    return out
