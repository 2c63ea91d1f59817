"""Fused batch-invariant ops: one kernel where the backend has it for what two ops do, with those
two ops' bits (scaled_rms_norm, add_rms_norm, rms_norm_rope, silu_mul); on a backend without
the kernel, the two ops themselves.

Guarantees: every non-NaN element is bitwise the separate ops' result (a NaN comes out as the
canonical NaN on CPU), so turning fusion on or off never moves bits; rows are independent, as for
every op of ops.py; add_rms_norm and rms_norm_rope are forward only (inference).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.inputs import check_float, check_forward_only, check_same_dtype, needs_autograd
from titan_audit.batch_invariant.ops import rms_norm


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
    check_float("x", x), check_float("weight", weight), check_same_dtype(x=x, weight=weight)
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
    if not needs_autograd(x, weight):
        return backend.rms_norm(x, weight, float(eps))[0]
    return _ScaledRMSNorm.apply(x, weight, float(eps))


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight, eps)): a residual add and the norm after it, for
    inference. One kernel where the backend has it (CPU), else these two ops; either way every
    non-NaN element is bitwise `h + delta` and `rms_norm(h + delta, weight, eps)` (a NaN comes
    out as the canonical NaN on CPU). Rows are independent. Forward only."""
    for name, t in (("h", h), ("delta", delta), ("weight", weight)):
        check_float(name, t)
    check_same_dtype(h=h, delta=delta, weight=weight)
    if h.shape != delta.shape or h.dim() == 0 or tuple(weight.shape) != (h.shape[-1],):
        raise ValueError(
            f"add_rms_norm: expected h and delta [..., N] of one shape and weight [N], got h {tuple(h.shape)}, "
            f"delta {tuple(delta.shape)}, weight {tuple(weight.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"add_rms_norm: eps must be >= 0, got {eps}")
    check_forward_only("add_rms_norm", h, delta, weight)
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
        check_float(name, t)
    check_same_dtype(x=x, weight=weight, cos=cos, sin=sin)
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
    check_forward_only("rms_norm_rope", x, weight, cos, sin)
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
    check_float("gate", gate), check_float("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    backend = backend_for(gate, up)
    if needs_autograd(gate, up):
        if not hasattr(backend, "silu_mul_backward") or gate.dtype != torch.float32 or up.dtype != torch.float32:
            raise ValueError(
                f"silu_mul has a backward for float32 gate and up on the CPU backend only (got {gate.dtype}, "
                f"{up.dtype} on {backend.NAME}); call it under torch.no_grad() or use the separate ops"
            )
        return _SiluMul.apply(gate, up)
    if not hasattr(backend, "silu_mul"):
        return backend.silu(gate) * up.float()
    return backend.silu_mul(gate, up)
