"""Shared pieces of the Triton-backend tests: the backend forced onto CPU tensors (Triton's
interpreter), float64 tolerances per dtype, and the shapes both the interpreter and GPU tests use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 4e-3, torch.float64: 1e-12}


@contextlib.contextmanager
def triton_on_cpu(order: str = "v2") -> Iterator[object]:
    """The Triton kernels, run by Triton's interpreter on CPU tensors, for the block only, in gemm
    order `order` (v2, the default order of a run, unless a test asks for v1)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    from titan_audit.batch_invariant import backend, gemm_order

    with backend.forced("triton") as module, gemm_order(order):
        yield module


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """|got - want| <= tol * (1 + |want|) element-wise, against a float64 reference."""
    err = (got.double() - want.double()).abs()
    bound = TOL[dtype] * (1 + want.double().abs())
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g} over tolerance {TOL[dtype]} ({dtype})"
