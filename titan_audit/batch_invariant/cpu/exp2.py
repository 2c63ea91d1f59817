"""In-place 2**x whose bits do not depend on where an element sits in its buffer.

Why this is needed. `torch.exp2` on a contiguous float32 buffer runs torch's vectorised loop:
full vectors (two SIMD registers a step, 32 floats on AVX512) through the vector exp2, then the
elements left over at the end of each thread's range through a scalar exp2 that rounds
differently for about 6% of inputs (tests/batch_invariant/test_reductions.py records it). Which
elements are left over depends on the buffer's length and the thread count, so a row's bits
would depend on what else is in the buffer. `torch.exp` has no such tail (every element gets
the same routine) but is about 4x slower here, which made it a fifth of a long prefill.

What this fixes. A buffer whose length `aligned_numel` chose has no left-over elements:
- up to `GRAIN` (ATen's `at::internal::GRAIN_SIZE`, below which an element-wise op runs on one
  thread) it is a multiple of 64, so the one range is whole vectors;
- up to `GRAIN * threads` it is a multiple of `GRAIN`: ATen's `parallel_for` then uses one thread
  per `GRAIN` elements, each range exactly `GRAIN` long;
- above that, a multiple of `GRAIN * threads`: every thread's range is a multiple of `GRAIN`.
So every element, real or padding, goes through the vector exp2, whatever the length or the
thread count (`torch.get_num_threads()` of the calling thread, which is the OpenMP team size).
If OMP_DYNAMIC lets OpenMP shrink teams, the ranges would move: then the buffer is done in
pieces of `PIECE` elements, each below `GRAIN` (one thread) and whole vectors: the same bits,
on one core. The padding holds whatever it held: 2**garbage is computed and never read. Tests
check the bits at 1 to 4 threads and on the piecewise path against a one-vector-at-a-time
reference, across lengths and offsets.
"""

from __future__ import annotations

import math
import os

import torch

GRAIN = 32768  # at::internal::GRAIN_SIZE
VECTOR_STEP = 64  # a multiple of the vector loop's step (2 registers: 32 floats on AVX512, 16 on AVX2)
PIECE = GRAIN - VECTOR_STEP  # below GRAIN (one thread), whole vector steps


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def aligned_numel(numel: int) -> int:
    """The buffer length (>= numel) at which `exp2_` computes every element with vector code."""
    if numel <= GRAIN:
        return _round_up(max(numel, 1), VECTOR_STEP)
    threads = max(1, torch.get_num_threads())
    if numel <= GRAIN * threads:
        return _round_up(numel, GRAIN)
    return _round_up(numel, GRAIN * threads)


def exp2_(buffer: torch.Tensor) -> torch.Tensor:
    """2**x in place over a contiguous 1-D float32 buffer of an `aligned_numel` length."""
    assert buffer.dim() == 1 and buffer.is_contiguous() and buffer.dtype == torch.float32
    assert buffer.numel() == aligned_numel(buffer.numel()), "exp2_ needs an aligned_numel length"
    if _dynamic_teams():
        for start in range(0, buffer.numel(), PIECE):
            buffer[start : start + PIECE].exp2_()
        return buffer
    return buffer.exp2_()


def _dynamic_teams() -> bool:
    """Whether OpenMP may give a parallel region fewer threads than asked (OMP_DYNAMIC)."""
    return os.environ.get("OMP_DYNAMIC", "false").strip().lower() not in ("", "false", "0")


LOG2_E = math.log2(math.e)


def _aligned_empty(shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer of an `aligned_numel` length, a view of its prefix with `shape`)."""
    numel = math.prod(shape)
    buffer = torch.empty(aligned_numel(numel))
    return buffer, buffer[:numel].view(shape)


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2**x for a float32 tensor, as a new tensor, with position-free bits (via `exp2_`)."""
    buffer, out = _aligned_empty(x.shape)
    out.copy_(x)
    exp2_(buffer)
    return out


def exp_via_exp2(x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """e**(x - shift), broadcasting shift, with bits that do not depend on an element's position:
    float32 as 2**((x - shift) * log2(e)) on an aligned buffer (about 4x faster than torch.exp
    here, one more rounding: a relative error under 1e-7 * |x - shift|); other dtypes torch.exp.
    Returns a new tensor of x's shape (a view of the buffer's prefix)."""
    if x.dtype != torch.float32:
        return torch.exp(x if shift is None else x - shift)
    buffer, out = _aligned_empty(torch.broadcast_shapes(x.shape, shift.shape) if shift is not None else x.shape)
    if shift is None:
        torch.mul(x, LOG2_E, out=out)
    else:
        torch.sub(x, shift, out=out).mul_(LOG2_E)
    exp2_(buffer)
    return out
