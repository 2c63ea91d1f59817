"""Input checks shared by the batch-invariant ops (ops.py, fused.py, attention.py).

Guarantees: a tensor that is not a floating tensor, or operands of mixed dtypes, are a ValueError
naming the argument; `needs_autograd` is true iff autograd would record the op (the ops then go
through their autograd Function; otherwise they call the same forward kernel directly, so the
bits are the same either way); a forward-only op called where autograd would record it is a
ValueError, never a silently missing gradient.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (float32, bfloat16, float16, float64), got {t.dtype}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtypes must match, got {', '.join(f'{n}={d}' for n, d in dtypes.items())}")


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record this op: without it the Function (same forward kernel, so
    the same bits) is skipped, which saves its bookkeeping on small problems."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_forward_only(name: str, *tensors: torch.Tensor) -> None:
    if needs_autograd(*tensors):
        raise ValueError(f"{name} is forward only (inference); call it under torch.no_grad() or use the separate ops")
