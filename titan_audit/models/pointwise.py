"""Position-independent `exp`, `sigmoid` and `silu` with autograd: an element's bits depend on its
value only, the same on every CPU and ISA variant.

Why this exists: on CPU, PyTorch's transcendental elementwise kernels run a SIMD approximation
(Sleef) over the body of a tensor and the scalar libm function over the tail that does not fill a
vector. The two can differ in the last bit, so `F.silu(x)[i]` depends on where element `i` sits in
the flattened tensor, i.e. on the batch size and on the other rows (tests/models/test_pointwise.py
keeps the negative control), and the vector routine chosen depends on the CPU.

These functions run the batch-invariant backend of the tensor's device (`batch_invariant.backend`):
on CPU our own compiled kernels (`titan_audit.batch_invariant.cpu.pointwise`, source
`batch_invariant/cpu/kernels/pointwise.cpp`), on CUDA (or a test's forced Triton backend) the
Triton kernels of `batch_invariant/gpu/pointwise.py`, which run the same sequences op for op and
give the same bits. exp = `ta::exp_f32` (our polynomial, within 2 ulp), sigmoid(x) =
1 / (1 + exp(-x)), silu(x) = x / (1 + exp(-x)); the backward passes are kernels of the same kind
(sigmoid: g * (y * (1 - y)); silu: g * (s * fma(x, 1 - s, 1)), s = sigmoid(x); exp: g * y, one
IEEE multiply). Each is a fixed sequence of IEEE operations per element, with no tail path. The
model uses these in batch-invariant mode only; outside it, the native (faster) kernels run.
Float32 compute: inputs of other floating dtypes are computed in float32 and the result is rounded
once to the input dtype. A device without a batch-invariant backend raises NotImplementedError
(`backend_for`) rather than running a variant kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from titan_audit.batch_invariant.backend import backend_for


def _needs_autograd(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = backend_for(x).exp(x).to(x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return (grad.float() * y.float()).to(grad.dtype)


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y32 = backend_for(x).sigmoid(x)
        ctx.save_for_backward(y32)
        return y32.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y32,) = ctx.saved_tensors
        return backend_for(grad, y32).sigmoid_backward(grad, y32).to(grad.dtype)


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return backend_for(x).silu(x).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return backend_for(grad, x).silu_backward(grad, x).to(grad.dtype)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, same bits for the same input element wherever it sits; differentiable."""
    return _Exp.apply(x) if _needs_autograd(x) else backend_for(x).exp(x).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), position independent (see module doc); differentiable."""
    return _Sigmoid.apply(x) if _needs_autograd(x) else backend_for(x).sigmoid(x).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) (as x / (1 + e^-x)), position independent (see module doc); differentiable."""
    return _Silu.apply(x) if _needs_autograd(x) else backend_for(x).silu(x).to(x.dtype)
