"""The batch-invariant functional ops (the matmul family, the reductions, rms_norm): input checks,
autograd, and dispatch to a device backend. The fused ops are in fused.py, attention in attention.py.

Guarantee: for every op here, the bits of a row of the output depend only on that row's input
(and the shared operand: weight, keys/values), never on how many rows are computed together.
"Row" means: a row of `a` for the matmul family; a slice along the non-reduced dims for the
reductions; a query row (b, h, i) for attention. The backward is deterministic (fixed order,
fixed shapes) and the input gradient is batch-invariant in the same sense; gradients of shared
operands (weight, bias, keys/values) are sums over rows, so they are deterministic but
necessarily depend on which rows were in the batch. Why each kernel is invariant is written
next to the kernel (batch_invariant/cpu/*.py).

Compute dtype: float32 (float64 inputs stay float64); bfloat16/float16 are upcast and the
result is rounded once to the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.inputs import check_float, check_same_dtype, needs_autograd

# ---------------------------------------------------------------- matmul family


class _MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return backend_for(a, b).mm(a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        be = backend_for(a, b)
        grad_a = be.mm(grad, b.t()) if ctx.needs_input_grad[0] else None  # per row of a
        grad_b = be.mm(a.t(), grad) if ctx.needs_input_grad[1] else None  # a sum over rows
        return grad_a, grad_b


class _Linear(torch.autograd.Function):
    """x [M, K] @ weight [N, K].T: `_MM` of (x, weight.t()), the same three gemms, with
    grad_weight computed as mm(grad.t(), x) [N, K] rather than mm(x.t(), grad).t(). Each element
    is the same products summed in the same order (the gemm order is a function of K alone), so
    the bits are equal; but weight.grad comes out a fresh row-major tensor like weight, so autograd
    accumulates a tied weight's two gradients, or the optimizer reads it, without a strided pass
    over a [vocab, hidden] matrix (that pass was ~2/3 of a BI step at qwen3-0.6b widths)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return backend_for(x, weight).mm(x, weight.t())

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        return linear_backward(grad, x, weight, need_x=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1])


def linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, need_x: bool = True, need_weight: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_x, grad_weight) of x [M, K] @ weight [N, K].T for grad [M, N] (see `_Linear`)."""
    be = backend_for(x, weight)
    grad_x = be.mm(grad, weight) if need_x else None  # per row of x
    grad_weight = be.mm(grad.t(), x) if need_weight else None  # a sum over rows, row-major like weight
    return grad_x, grad_weight


class _BMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return backend_for(a, b).bmm(a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        be = backend_for(a, b)
        grad_a = be.bmm(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = be.bmm(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N]; row i of the result depends only on a[i] and b."""
    check_float("a", a), check_float("b", b), check_same_dtype(a=a, b=b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"mm: expected a [M, K] and b [K, N], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if not needs_autograd(a, b):
        return backend_for(a, b).mm(a, b)
    return _MM.apply(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; row (j, i) depends only on a[j, i] and b[j]."""
    check_float("a", a), check_float("b", b), check_same_dtype(a=a, b=b)
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm: expected a [B, M, K] and b [B, K, N], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if not needs_autograd(a, b):
        return backend_for(a, b).bmm(a, b)
    return _BMM.apply(a, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul semantics (1-D, 2-D and broadcast batched operands) on the invariant kernels."""
    check_float("a", a), check_float("b", b), check_same_dtype(a=a, b=b)
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"matmul: operands must be at least 1-D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    k = a.shape[-1]
    k_b = b.shape[0] if b.dim() == 1 else b.shape[-2]
    if k != k_b:
        raise ValueError(f"matmul: a {tuple(a.shape)} and b {tuple(b.shape)} do not agree on the contracted dim")
    if b.dim() <= 2:
        b2 = b.unsqueeze(-1) if b.dim() == 1 else b
        out = mm(a.reshape(-1, k), b2).reshape(*a.shape[:-1], b2.shape[-1])
        return out.squeeze(-1) if b.dim() == 1 else out
    a3 = a.unsqueeze(0) if a.dim() == 1 else a
    batch = torch.broadcast_shapes(a3.shape[:-2], b.shape[:-2])
    m, n = a3.shape[-2], b.shape[-1]
    out = bmm(
        a3.expand(*batch, m, k).reshape(-1, m, k),
        b.expand(*batch, k, n).reshape(-1, k, n),
    ).reshape(*batch, m, n)
    return out.squeeze(-2) if a.dim() == 1 else out


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """beta * bias + alpha * (a @ b), the product by `mm`, the rest element-wise (per row)."""
    check_float("bias", bias)
    out = mm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    try:
        torch.broadcast_shapes(bias.shape, out.shape)
    except RuntimeError:
        raise ValueError(f"addmm: bias {tuple(bias.shape)} does not broadcast to {tuple(out.shape)}") from None
    return out + (bias if beta == 1 else bias * beta)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]); every row of x independently."""
    check_float("x", x), check_float("weight", weight), check_same_dtype(x=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: expected x [..., K] and weight [N, K], got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if needs_autograd(x, weight):
        out = _Linear.apply(x2, weight)
    else:
        out = backend_for(x, weight).mm(x2, weight.t())
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


# ---------------------------------------------------------------- reductions


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dims: list[int], keepdim: bool, mean: bool) -> torch.Tensor:
        ctx.shape, ctx.dims, ctx.keepdim = x.shape, dims, keepdim
        count = 1
        for d in dims:
            count *= x.shape[d]
        ctx.scale = 1.0 / count if mean else 1.0
        out = backend_for(x).sum_dims(x, dims, keepdim)
        if mean:
            out = out / count
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.keepdim:
            for d in sorted(ctx.dims):
                grad = grad.unsqueeze(d)
        grad = grad * ctx.scale if ctx.scale != 1.0 else grad
        return grad.expand(ctx.shape).contiguous(), None, None, None


def _norm_dim(x: torch.Tensor, dim: int, name: str = "dim") -> int:
    if not isinstance(dim, int) or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
        raise ValueError(f"{name}={dim!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % max(x.dim(), 1)


def sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:  # noqa: A001
    """Sum over `dim` by a fixed pairwise tree over that dim's length."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("sum: x must be at least 1-D, got a 0-d tensor")
    return _Sum.apply(x, [_norm_dim(x, dim)], keepdim, False)


def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Mean over `dim`: the fixed-tree sum divided by the length."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("mean: x must be at least 1-D, got a 0-d tensor")
    return _Sum.apply(x, [_norm_dim(x, dim)], keepdim, True)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: bool) -> torch.Tensor:
        be = backend_for(x)
        y = be.log_softmax(x) if log else be.softmax(x)
        ctx.save_for_backward(y)
        ctx.log, ctx.dtype = log, x.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        be = backend_for(y)
        out = be.log_softmax_backward(grad, y) if ctx.log else be.softmax_backward(grad, y)
        return out.to(ctx.dtype), None


def _softmax_along(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("softmax: x must be at least 1-D, got a 0-d tensor")
    dim = _norm_dim(x, dim)
    moved = x.movedim(dim, -1)
    if not needs_autograd(x):  # the same forward kernel without the Function's bookkeeping
        be = backend_for(moved)
        return (be.log_softmax(moved) if log else be.softmax(moved)).to(x.dtype).movedim(-1, dim)
    return _Softmax.apply(moved, log).movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim`: exact row max, element-wise exp, fixed-tree sum."""
    return _softmax_along(x, dim, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-softmax along `dim`: x - max - log(fixed-tree sum of exp(x - max))."""
    return _softmax_along(x, dim, log=True)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        y, rstd = backend_for(x, weight).rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = backend_for(x, weight).rms_norm_backward(grad, x, weight, rstd)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_x.to(x.dtype), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(mean(x^2, last dim) + eps) * weight, the mean by the fixed tree."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("rms_norm: x must be at least 1-D, got a 0-d tensor")
    if weight is not None:
        check_float("weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(
                f"rms_norm: weight must have shape ({x.shape[-1]},) for x {tuple(x.shape)}, got {tuple(weight.shape)}"
            )
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    if not needs_autograd(x, weight):  # the same forward kernel without the Function's bookkeeping
        return backend_for(x, weight).rms_norm(x, weight, float(eps))[0].to(x.dtype)
    return _RMSNorm.apply(x, weight, float(eps))


__all__ = [
    "addmm",
    "bmm",
    "linear",
    "linear_backward",
    "log_softmax",
    "matmul",
    "mean",
    "mm",
    "rms_norm",
    "softmax",
    "sum",
]
