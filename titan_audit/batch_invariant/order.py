"""The gemm summation order of batch-invariant mode, process-wide: "v2" (the default) or "v1".

"v1": every output of a gemm is one fma chain over k = 0..K-1 (`cpu/matmul.py`, `blocks=1`).
"v2": the blocked halving tree over P(K) = `tree_blocks(K)` blocks of one chain each, whose
contiguous K-shards of a whole subtree reproduce the unsharded sum (what tensor parallelism needs;
`cpu/matmul.py`'s docstring states the rule). For a K with P(K) == 1 both orders are one chain.

Guarantees:
- One order for the whole process (every thread: a run's rollout thread follows its trainer), read
  by the CPU backend's `mm` / `bmm` at each call, so every batch-invariant gemm (mm, bmm, addmm,
  linear, matmul; forward, grad_a and grad_b; the functional ops and the aten override mode alike)
  sums in that order. `gemm_order(order)` sets it for a block and restores the previous order on
  exit (also on an exception); `set_gemm_order` is the switch; `current_gemm_order()` reads it.
- The config key `determinism.bi_kernels` (trainer and RL configs) names the order a run enters
  (trainer/run.py); an unknown name is a ValueError naming that key (`check_gemm_order`).
- Both backends follow the order: the CPU gemm inside its kernel (cpu/matmul.py), the Triton gemm
  by P(K) block partials combined by `tree_combine` (gpu/matmul.py).
- The numerics fingerprint's `bi_kernels` names the order (deterministic/numerics.py), so a golden
  recorded under one order checks exact only under the same order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

GEMM_ORDERS = ("v1", "v2")
DEFAULT_GEMM_ORDER = "v2"
CONFIG_KEY = "determinism.bi_kernels"

_LOCK = threading.Lock()
_ORDER = [DEFAULT_GEMM_ORDER]  # one process-wide value (a list: rebound under the lock)


def check_gemm_order(order: object, key: str = CONFIG_KEY) -> str:
    """`order` if it names a gemm order, else ValueError naming `key`."""
    if order not in GEMM_ORDERS:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, GEMM_ORDERS))}, got {order!r}")
    return order  # type: ignore[return-value]


def current_gemm_order() -> str:
    """The gemm order batch-invariant gemms use now ("v1" or "v2")."""
    return _ORDER[0]


def set_gemm_order(order: str) -> str:
    """Make `order` the process's gemm order; returns the previous one."""
    check_gemm_order(order, "gemm_order")
    with _LOCK:
        previous, _ORDER[0] = _ORDER[0], order
    return previous


@contextlib.contextmanager
def gemm_order(order: str) -> Iterator[None]:
    """The gemm order `order` for the block; the previous order after it."""
    previous = set_gemm_order(order)
    try:
        yield
    finally:
        set_gemm_order(previous)


def tree_blocks(k: int) -> int:
    """P(K): the largest power of two P with K % P == 0 and K / P >= 64 (1 when no such P > 1)."""
    p = 1
    while k % (2 * p) == 0 and k // (2 * p) >= 64:
        p *= 2
    return p


def tree_combine(partials: list[torch.Tensor]) -> torch.Tensor:
    """The halving tree over a power-of-two list: node [lo, hi) = node [lo, mid) + node [mid, hi)."""
    n = len(partials)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_combine: {n} partials, need a power of two")
    if n == 1:
        return partials[0]
    return tree_combine(partials[: n // 2]) + tree_combine(partials[n // 2 :])


def gemm_blocks(k: int) -> int:
    """The block count of a K-long gemm sum under the current order: 1 (v1) or P(K) (v2)."""
    return tree_blocks(k) if _ORDER[0] == "v2" else 1
