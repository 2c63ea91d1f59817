"""The embedding's weight gradient on our kernel (`kernels/embedding.cpp`), in a fixed order.

Guarantee: `embedding_backward(grad, indices, num_weights, padding_idx)` returns [V, D] float32
where row v is the sum of the grad rows whose index is v, added in ascending position from +0.0
(rows of `padding_idx` add nothing): one chain of IEEE adds per element, the same bits for any
thread count, ISA variant or CPU. Inputs of other floating dtypes are upcast exactly to float32;
the caller rounds the result once.
"""

from __future__ import annotations

import ctypes

import torch

from titan_audit.batch_invariant.cpu import _lib

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_lib.declare("embedding_backward_f32", None, [_P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int])


def embedding_backward(
    grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1
) -> torch.Tensor:
    """grad [..., D] of the looked-up rows, indices [...] (integers) -> float32 [num_weights, D]."""
    dim = grad.shape[-1]
    flat_grad = grad.reshape(-1, dim).to(torch.float32).contiguous()
    flat_idx = indices.reshape(-1).to(torch.int64).contiguous()
    if flat_idx.numel() != flat_grad.shape[0]:
        raise ValueError(f"embedding_backward: {flat_idx.numel()} indices for {flat_grad.shape[0]} grad rows")
    out = _lib.output((num_weights, dim), torch.float32)
    threads = _lib.num_threads() if flat_grad.numel() >= 1 << 15 else 1
    _lib.kernel("embedding_backward_f32")(
        _lib.ptr(flat_grad), _lib.ptr(flat_idx), _lib.ptr(out), flat_idx.numel(), dim, num_weights, padding_idx, threads
    )
    return out
