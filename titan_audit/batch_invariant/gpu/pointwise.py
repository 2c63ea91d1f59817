"""Triton element-wise exp, exp2, log, sqrt, sigmoid, silu and the backward of sigmoid and silu,
float32, in the CPU kernels' sequences (`cpu/kernels/pointwise.cpp`, `ta_math.h`) op for op.

Guarantee: an element's bits are a function of its value alone (and of its gradient's), whatever
the tensor's length, the block width or where the element sits: each element runs one fixed
sequence of IEEE operations (the same list as the CPU kernels', written out below), there is no
tail path, no table, no library call, and programs only split the buffer. Every NaN result is
the one quiet NaN 0x7fc00000, as on the CPU.

Why the bits equal the CPU kernels': the sequence is the same and every operation is correctly
rounded on both sides: `tl.fma` where the C++ has `std::fma`, `tl.div_rn` / `tl.sqrt_rn` (Triton's
plain `/` and `tl.sqrt` are approximate on NVIDIA GPUs), integer bit operations for 2^n and the
exponent split, and launches compiled with `enable_fp_fusion=False` so no multiply-add is
contracted. In Triton's interpreter (CPU tensors, tests) the bits are checked equal to the CPU
kernels' (tests/batch_invariant/test_triton_pointwise.py); on a GPU they are expected equal for
the same reason: compiled for sm_90, the PTX holds div.rn / sqrt.rn, no approximate ex2 / lg2 /
rcp, and exactly the fmas written here (tests/batch_invariant/test_triton_compile.py); the bits
on a GPU are checked by scripts/gpu_check.sh, which no GPU has run yet.

    exp  = ta::exp_f32: clamp to [-110, 89]; n = rint(x * log2e) by the 1.5 * 2^23 trick;
           r = fma(-n, ln2_hi, x); r = fma(-n, ln2_lo, r); Taylor degree 7 (Horner, fma);
           times 2^n as two normal factors (scale_pow2)
    exp2 = ta::exp2_f32       log = ta::log_f32       sqrt = IEEE sqrt
    e = exp(-|x|), num = (1 if x >= 0 else e)
    sigmoid(x) = num / (1 + e)                  silu(x) = (x * num) / (1 + e)
    sigmoid'(g, y) = g * (y * (1 - y))         silu'(g, x) = g * (s * fma(x, 1 - s, 1)), s = sigmoid(x)

Dtypes: float32 compute; other floating inputs are converted to float32 exactly and the result is
float32 (callers round once). float64 has no Triton kernel here: it raises NotImplementedError
rather than running a native, position-dependent kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import check_device, interpreted, jit, launch_options

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + magic) - magic == rint(v) for |v| < 2^22
QNAN_BITS = tl.constexpr(0x7FC00000)


@jit
def _canon(y):
    """Any NaN becomes 0x7fc00000 (ta::canon_nan_f32)."""
    return tl.where(y != y, tl.full(y.shape, QNAN_BITS, tl.int32).to(tl.float32, bitcast=True), y)


@jit
def _scale_pow2(p, n):
    """p * 2^n for an integer-valued float n in [-252, 254], as (p * 2^n1) * 2^n2, n1 = floor(n / 2)."""
    ni = n.to(tl.int32)
    n1 = ni >> 1
    n2 = ni - n1
    s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((n2 + 127) << 23).to(tl.float32, bitcast=True)
    return (p * s1) * s2


@jit
def _exp_f32(x):
    x = tl.where(x < -110.0, -110.0, x)
    x = tl.where(x > 89.0, 89.0, x)
    n = (x * 1.4426950408889634 + ROUND_MAGIC) - ROUND_MAGIC
    r = tl.fma(-n, 6.93145752e-01, x)  # ln2 hi
    r = tl.fma(-n, 1.42860677e-06, r)  # ln2 lo
    p = tl.full(x.shape, 1.9841269841269841e-04, tl.float32)  # 1/7!
    p = tl.fma(p, r, 1.3888888888888889e-03)
    p = tl.fma(p, r, 8.3333333333333333e-03)
    p = tl.fma(p, r, 4.1666666666666667e-02)
    p = tl.fma(p, r, 1.6666666666666667e-01)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    return _scale_pow2(p, n)


@jit
def _exp2_f32(x):
    x = tl.where(x < -160.0, -160.0, x)
    x = tl.where(x > 128.0, 128.0, x)
    n = (x + ROUND_MAGIC) - ROUND_MAGIC
    f = x - n
    p = tl.full(x.shape, 1.5252733804059841e-05, tl.float32)  # ln2^7 / 7!
    p = tl.fma(p, f, 1.5403530393381609e-04)
    p = tl.fma(p, f, 1.3333558146428443e-03)
    p = tl.fma(p, f, 9.6181291076284772e-03)
    p = tl.fma(p, f, 5.5504108664821580e-02)
    p = tl.fma(p, f, 2.4022650695910071e-01)
    p = tl.fma(p, f, 6.9314718055994531e-01)
    p = tl.fma(p, f, 1.0)
    return _scale_pow2(p, n)


@jit
def _log_f32(x):
    sub = x < 1.17549435e-38  # also true for 0 and negatives (fixed up below)
    xs = tl.where(sub, x * 8388608.0, x)
    eadj = tl.where(sub, -23.0, 0.0)
    u = xs.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) - 127
    m = ((u & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > 1.41421356
    m = tl.where(big, m * 0.5, m)
    ef = (e + big.to(tl.int32)).to(tl.float32) + eadj
    f = m - 1.0
    s = tl.div_rn(f, 2.0 + f)
    z = s * s
    p = tl.full(x.shape, 2.0 / 9.0, tl.float32)
    p = tl.fma(p, z, 2.0 / 7.0)
    p = tl.fma(p, z, 2.0 / 5.0)
    p = tl.fma(p, z, 2.0 / 3.0)
    p = tl.fma(p, z, 2.0)
    logm = p * s
    r = tl.fma(ef, 6.93145752e-01, tl.fma(ef, 1.42860677e-06, logm))
    inf = tl.full(x.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    r = tl.where(x == 0.0, -inf, r)
    r = tl.where(x < 0.0, float("nan"), r)
    r = tl.where(x == inf, inf, r)
    return tl.where(x != x, x, r)


@jit
def _sigmoid_parts(x):
    """(num, 1 + e) with e = exp(-|x|) and num = 1 for x >= 0, else e."""
    e = _exp_f32(-tl.abs(x))
    return tl.where(x >= 0.0, 1.0, e), 1.0 + e


@jit
def _unary_kernel(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if OP == "exp":
        y = _exp_f32(x)
    elif OP == "exp2":
        y = _exp2_f32(x)
    elif OP == "log":
        y = _log_f32(x)
    elif OP == "sqrt":
        y = tl.sqrt_rn(x)
    elif OP == "sigmoid":
        num, den = _sigmoid_parts(x)
        y = tl.div_rn(num, den)
    else:  # silu
        num, den = _sigmoid_parts(x)
        y = tl.div_rn(x * num, den)
    tl.store(y_ptr + offs, _canon(y), mask=mask)


@jit
def _backward_kernel(g_ptr, saved_ptr, gx_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    v = tl.load(saved_ptr + offs, mask=mask, other=0.0)
    if OP == "sigmoid_backward":  # v: sigmoid's output
        gx = g * (v * (1.0 - v))
    else:  # silu_backward, v: silu's input
        num, den = _sigmoid_parts(v)
        s = tl.div_rn(num, den)
        gx = g * (s * tl.fma(v, 1.0 - s, 1.0))
    tl.store(gx_ptr + offs, _canon(gx), mask=mask)


def _block(t: torch.Tensor) -> int:
    return 256 if interpreted(t) else 1024


def _f32(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"pointwise {name}: expected a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dtype == torch.float64:
        raise NotImplementedError(
            f"pointwise {name}: no float64 Triton kernel; refusing to fall back to a native kernel, "
            "whose bits depend on an element's position"
        )
    return x.to(torch.float32).contiguous()


def _launch(kernel: Any, name: str, *inputs: torch.Tensor) -> torch.Tensor:
    """`kernel` over the float32 copies of `inputs` (one shape), one program per BLOCK elements."""
    check_device(*inputs)
    inputs = tuple(_f32(name, t) for t in inputs)
    if any(t.shape != inputs[0].shape for t in inputs):
        raise ValueError(f"{name}: inputs of shapes {[tuple(t.shape) for t in inputs]} must have one shape")
    out = torch.empty_like(inputs[0])
    if out.numel():
        block = _block(out)
        grid = (triton.cdiv(out.numel(), block),)
        kernel[grid](*inputs, out, out.numel(), OP=name, BLOCK=block, **launch_options(out, 4))
    return out


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    return _launch(_unary_kernel, name, x)


def _binary(name: str, grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    return _launch(_backward_kernel, name, grad, saved)


def exp(x: torch.Tensor) -> torch.Tensor:
    """ta::exp_f32 element by element (float32 result)."""
    return _unary("exp", x)


def exp2(x: torch.Tensor) -> torch.Tensor:
    """ta::exp2_f32 element by element (float32 result)."""
    return _unary("exp2", x)


def log(x: torch.Tensor) -> torch.Tensor:
    """ta::log_f32 element by element (float32 result)."""
    return _unary("log", x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root element by element (float32 result)."""
    return _unary("sqrt", x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """num / (1 + e), e = exp(-|x|), num = 1 if x >= 0 else e (float32 result)."""
    return _unary("sigmoid", x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """(x * num) / (1 + e), as `sigmoid` (float32 result)."""
    return _unary("silu", x)


def sigmoid_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """grad * (y * (1 - y)) from sigmoid's output y (float32 result)."""
    return _binary("sigmoid_backward", grad, y)


def silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad * (s * fma(x, 1 - s, 1)), s = sigmoid(x), from silu's input x (float32 result)."""
    return _binary("silu_backward", grad, x)
