"""The batch-invariant functional ops: input checks, autograd, and dispatch to a device backend.

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

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (float32, bfloat16, float16, float64), got {t.dtype}")


def _check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtypes must match, got {', '.join(f'{n}={d}' for n, d in dtypes.items())}")


# ---------------------------------------------------------------- matmul family


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record this op: without it the Function (same forward kernel, so
    the same bits) is skipped, which saves its bookkeeping on small problems."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    _check_float("a", a), _check_float("b", b), _check_same_dtype(a=a, b=b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"mm: expected a [M, K] and b [K, N], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if not _needs_autograd(a, b):
        return backend_for(a, b).mm(a, b)
    return _MM.apply(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; row (j, i) depends only on a[j, i] and b[j]."""
    _check_float("a", a), _check_float("b", b), _check_same_dtype(a=a, b=b)
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm: expected a [B, M, K] and b [B, K, N], got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if not _needs_autograd(a, b):
        return backend_for(a, b).bmm(a, b)
    return _BMM.apply(a, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul semantics (1-D, 2-D and broadcast batched operands) on the invariant kernels."""
    _check_float("a", a), _check_float("b", b), _check_same_dtype(a=a, b=b)
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
    _check_float("bias", bias)
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
    _check_float("x", x), _check_float("weight", weight), _check_same_dtype(x=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: expected x [..., K] and weight [N, K], got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if _needs_autograd(x, weight):
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
    _check_float("x", x)
    if x.dim() == 0:
        raise ValueError("sum: x must be at least 1-D, got a 0-d tensor")
    return _Sum.apply(x, [_norm_dim(x, dim)], keepdim, False)


def mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Mean over `dim`: the fixed-tree sum divided by the length."""
    _check_float("x", x)
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
    _check_float("x", x)
    if x.dim() == 0:
        raise ValueError("softmax: x must be at least 1-D, got a 0-d tensor")
    dim = _norm_dim(x, dim)
    moved = x.movedim(dim, -1)
    if not _needs_autograd(x):  # the same forward kernel without the Function's bookkeeping
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
    _check_float("x", x)
    if x.dim() == 0:
        raise ValueError("rms_norm: x must be at least 1-D, got a 0-d tensor")
    if weight is not None:
        _check_float("weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(
                f"rms_norm: weight must have shape ({x.shape[-1]},) for x {tuple(x.shape)}, got {tuple(weight.shape)}"
            )
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    if not _needs_autograd(x, weight):  # the same forward kernel without the Function's bookkeeping
        return backend_for(x, weight).rms_norm(x, weight, float(eps))[0].to(x.dtype)
    return _RMSNorm.apply(x, weight, float(eps))


class _ScaledRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = backend_for(x, weight).rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = backend_for(x, weight).rms_norm_scaled_backward(grad, x, weight, rstd)
        return grad_x, grad_w, None


def scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`weight * rms_norm(x, None, eps)` for float32 or float64 x and weight [N] of x's dtype
    (the weight applied after the norm, as HF's RMSNorm and the model compose it), forward and
    backward bitwise those two ops': the forward is `rms_norm`'s kernel with the weight (x * rstd,
    then times the weight: the same two roundings) and the backward one kernel where the backend
    has it (CPU: the multiply's gradient into the norm's backward, and the weight's gradient, a sum
    over rows of grad * normed, in `sum`'s order); on other backends the two ops. Saves the
    multiply's launch and its saved tensor, and for training the sum over rows' transposed copy."""
    _check_float("x", x), _check_float("weight", weight), _check_same_dtype(x=x, weight=weight)
    if x.dtype not in (torch.float32, torch.float64) or x.dim() == 0 or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"scaled_rms_norm: expected float32 or float64 x [..., N] and weight [N] of its dtype, got x "
            f"{x.dtype}{list(x.shape)} and weight {weight.dtype}{list(weight.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"scaled_rms_norm: eps must be >= 0, got {eps}")
    backend = backend_for(x, weight)
    if not hasattr(backend, "rms_norm_scaled_backward") or torch.compiler.is_compiling():
        return weight * rms_norm(x, None, eps)  # a backend without the kernel: its own two ops
    if not _needs_autograd(x, weight):
        return backend.rms_norm(x, weight, float(eps))[0]
    return _ScaledRMSNorm.apply(x, weight, float(eps))


# ---------------------------------------------------------------- fused inference ops (forward only)


def _check_forward_only(name: str, *tensors: torch.Tensor) -> None:
    if _needs_autograd(*tensors):
        raise ValueError(f"{name} is forward only (inference); call it under torch.no_grad() or use the separate ops")


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight, eps)): a residual add and the norm after it, for
    inference. One kernel where the backend has it (CPU), else these two ops; either way every
    non-NaN element is bitwise `h + delta` and `rms_norm(h + delta, weight, eps)` (a NaN comes
    out as the canonical NaN on CPU). Rows are independent. Forward only."""
    for name, t in (("h", h), ("delta", delta), ("weight", weight)):
        _check_float(name, t)
    _check_same_dtype(h=h, delta=delta, weight=weight)
    if h.shape != delta.shape or h.dim() == 0 or tuple(weight.shape) != (h.shape[-1],):
        raise ValueError(
            f"add_rms_norm: expected h and delta [..., N] of one shape and weight [N], got h {tuple(h.shape)}, "
            f"delta {tuple(delta.shape)}, weight {tuple(weight.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"add_rms_norm: eps must be >= 0, got {eps}")
    _check_forward_only("add_rms_norm", h, delta, weight)
    backend = backend_for(h, delta, weight)
    if not hasattr(backend, "add_rms_norm"):
        s = h + delta
        return s, rms_norm(s, weight, eps)
    s, y = backend.add_rms_norm(h, delta, weight, float(eps))
    return s.to(h.dtype), y.to(h.dtype)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """q/k-norm then rotate-half RoPE, for inference: x [N, H, d] (the heads of N tokens, d even),
    weight [H, d] or [d], cos / sin [N, d]; returns [N, H, d] = rope(rms_norm(x) * weight) with
    rope(n) = n * cos + rotate_half(n) * sin, rotate_half(n) = cat(-n[d/2:], n[:d/2]). One kernel
    where the backend has it (CPU), else these ops; either way every non-NaN element is bitwise
    `rms_norm(x, None, eps) * weight` followed by `models.rope.apply_rope` (a NaN comes out as the
    canonical NaN on CPU). x may be a strided view (q's and k's heads of one projection). Forward
    only."""
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        _check_float(name, t)
    _check_same_dtype(x=x, weight=weight, cos=cos, sin=sin)
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"rms_norm_rope: x must be [N, H, d] with d even, got {tuple(x.shape)}")
    tokens, heads, d = x.shape
    if tuple(weight.shape) not in ((heads, d), (d,)) or cos.shape != (tokens, d) or sin.shape != (tokens, d):
        raise ValueError(
            f"rms_norm_rope: for x {tuple(x.shape)} expected weight [{heads}, {d}] or [{d}] and cos / sin "
            f"[{tokens}, {d}], got weight {tuple(weight.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"rms_norm_rope: eps must be >= 0, got {eps}")
    _check_forward_only("rms_norm_rope", x, weight, cos, sin)
    weight_Hd = weight.expand(heads, d)
    backend = backend_for(x, weight, cos, sin)
    if not hasattr(backend, "rms_norm_rope"):
        n = backend.rms_norm(x, None, float(eps))[0].to(x.dtype) * weight_Hd
        rotated = torch.cat((-n[..., d // 2 :], n[..., : d // 2]), dim=-1)
        return n * cos[:, None] + rotated * sin[:, None]
    return backend.rms_norm_rope(x, weight_Hd, cos, sin, float(eps)).to(x.dtype)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return backend_for(gate, up).silu_mul(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return backend_for(gate, up).silu_mul_backward(grad, gate, up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU's product) in float32: one kernel where the backend has it (CPU),
    else the backend's silu and one multiply; either way every non-NaN element is bitwise
    `silu(gate) * up` (a NaN comes out as the canonical NaN on CPU). gate and up may be strided
    views (the two halves of one fused gate/up projection). With autograd (float32 gate and up,
    a backend with `silu_mul_backward`: CPU) the backward is one kernel too, with the bits of the
    multiply's backward followed by silu's (`grad * up` into silu_backward, `grad * silu(gate)`);
    elsewhere forward only."""
    _check_float("gate", gate), _check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    backend = backend_for(gate, up)
    if _needs_autograd(gate, up):
        if not hasattr(backend, "silu_mul_backward") or gate.dtype != torch.float32 or up.dtype != torch.float32:
            raise ValueError(
                f"silu_mul has a backward for float32 gate and up on the CPU backend only (got {gate.dtype}, "
                f"{up.dtype} on {backend.NAME}); call it under torch.no_grad() or use the separate ops"
            )
        return _SiluMul.apply(gate, up)
    if not hasattr(backend, "silu_mul"):
        return backend.silu(gate) * up.float()
    return backend.silu_mul(gate, up)


# ---------------------------------------------------------------- attention


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        q_positions: torch.Tensor,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        out, lse = backend_for(q, k, v).attention_forward(q, k, v, scale, causal, q_positions, doc_ids)
        ctx.save_for_backward(q, k, v, out, lse, q_positions, doc_ids)
        ctx.scale, ctx.causal = scale, causal
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, q_positions, doc_ids = ctx.saved_tensors
        dq, dk, dv = backend_for(q, k, v).attention_backward(
            grad, q, k, v, out, lse, ctx.scale, ctx.causal, q_positions, doc_ids
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _positions(q_positions: torch.Tensor | None, batch: int, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """The query positions [B, Tq] (long) on the device of q (no host-device copy on CUDA)."""
    if q_positions is None:
        return torch.arange(tk - tq, tk, device=device).expand(batch, tq)
    if not isinstance(q_positions, torch.Tensor) or q_positions.dtype not in (torch.int64, torch.int32):
        raise ValueError("q_positions must be an integer (long) tensor of shape [Tq] or [B, Tq]")
    if q_positions.shape not in (torch.Size([tq]), torch.Size([batch, tq])):
        raise ValueError(f"q_positions must have shape [{tq}] or [{batch}, {tq}], got {tuple(q_positions.shape)}")
    if q_positions.numel() and int(q_positions.min()) < 0:
        raise ValueError("q_positions must be >= 0")
    return q_positions.long().to(device).expand(batch, tq)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    q_positions: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention with a key-chunked, position-aligned reduction order.

    q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] with Hq % Hkv == 0 (query head h uses kv head
    h // (Hq // Hkv)). Key j sits at absolute position j. `q_positions` (None: the last Tq
    positions, Tk - Tq + i) is a LongTensor [Tq] or [B, Tq]. causal: key j visible iff
    j <= position. `doc_ids` [B, Tk]: a query sees only keys of its own document; ids < 0 are
    padding keys, never visible. A query with no visible key gets zeros. Output [B, Hq, Tq, D]
    in q's dtype; its row (b, h, i) is bitwise independent of B, Tq, Tk and invisible keys.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D [B, H, T, D], got {tuple(t.shape)}")
    _check_same_dtype(q=q, k=k, v=v)
    batch, hq, tq, dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(
            f"attention: expected k and v [B={batch}, Hkv, Tk, D={dim}], got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    hkv, tk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q_positions is None and tq > tk:
        raise ValueError(f"attention: Tq={tq} > Tk={tk} needs explicit q_positions")
    positions = _positions(q_positions, batch, tq, tk, q.device)
    if doc_ids is not None:
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError("doc_ids must be an integer (long) tensor of shape [B, Tk]")
        if tuple(doc_ids.shape) != (batch, tk):
            raise ValueError(f"doc_ids must have shape [{batch}, {tk}], got {tuple(doc_ids.shape)}")
        if positions.numel() and int(positions.max()) >= tk:
            raise ValueError(f"attention: with doc_ids every query position must be < Tk={tk}")
        doc_ids = doc_ids.long()
    if scale is None:
        scale = dim**-0.5
    if not _needs_autograd(q, k, v):  # the same forward kernel without the Function's bookkeeping
        out, _ = backend_for(q, k, v).attention_forward(
            q, k, v, float(scale), bool(causal), positions.contiguous(), doc_ids
        )
        return out.to(q.dtype)
    return _Attention.apply(q, k, v, float(scale), bool(causal), positions.contiguous(), doc_ids)


__all__ = [
    "add_rms_norm",
    "addmm",
    "attention",
    "bmm",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "mm",
    "rms_norm",
    "rms_norm_rope",
    "silu_mul",
    "softmax",
    "sum",
]
