"""Shared helpers for the batch_invariant tests: seeded tensors and a thread-count guard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
