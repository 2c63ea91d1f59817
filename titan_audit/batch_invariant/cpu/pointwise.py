"""CPU element-wise exp, exp2, log, sqrt, sigmoid, silu (and the backward of sigmoid and silu) on our
own compiled kernels (`kernels/pointwise.cpp`).

Guarantee: an element's result is a function of its value alone (for a backward: of its value
and its gradient), the same bits wherever it sits in a tensor, whatever the tensor's length, the
thread count or the ISA variant. Torch's versions are not: their vector body and scalar tail
round differently (tests/models/test_pointwise.py and tests/batch_invariant/test_math.py keep
the negative controls). The sequences, written next to each kernel:
    exp  = ta::exp_f32        exp2 = ta::exp2_f32          log = ta::log_f32      sqrt = IEEE sqrt
    e = exp(-|x|), num = (1 if x >= 0 else e)     (no overflow; tiny results stay accurate)
    sigmoid(x) = num / (1 + e)                  silu(x) = (x * num) / (1 + e)
    sigmoid'(g, y) = g * (y * (1 - y))         silu'(g, x) = g * (s * fma(x, 1 - s, 1)), s = sigmoid(x)
    silu_mul(g, u) = silu(g) * u               its backward: silu'(dy * u, g) and dy * silu(g)

Dtypes: `exp`, `log` and `sqrt` of a float64 tensor run the float64 kernels (`exp_f64`, `log_f64`,
correctly rounded sqrt; float64 result; same guarantee; accuracy in ta_math.h: 0.90 / 2.93 /
0.5 ulp). Everything else computes in float32: inputs of other floating dtypes are converted to
float32 and the result is float32 (callers round it). Forward-only; `titan_audit.models.pointwise`
and `batch_invariant.silu_mul` add autograd. Each function is also a `torch.library` custom op
(`titan_audit::silu`, ...) with a fake implementation, used while `torch.compile` traces; eager
calls go to the kernel directly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from titan_audit.batch_invariant.cpu import _lib

PARALLEL_MIN_ELEMENTS = 1 << 16  # below this one thread does the call (threads never change bits)

UNARY = ("exp", "exp2", "log", "sqrt", "sigmoid", "silu")
BINARY = ("sigmoid_backward", "silu_backward")
FLOAT64 = ("exp", "log", "sqrt")  # these take float64 to float64 kernels

for _name in UNARY:
    _lib.declare(f"{_name}_f32", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
for _name in FLOAT64:
    _lib.declare(f"{_name}_f64", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
for _name in BINARY:
    _lib.declare(f"{_name}_f32", None, [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int])
_lib.declare("silu_mul_f32", None, [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int])
_lib.declare("silu_mul_backward_f32", None, [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int])


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"pointwise: expected a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.device.type != "cpu":
        raise ValueError(f"pointwise: the CPU kernels need a CPU tensor, got one on {x.device}")


def _f32(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    return x.to(torch.float32).contiguous()


def result_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype `name` computes in and returns for an input of `dtype`."""
    return torch.float64 if dtype == torch.float64 and name in FLOAT64 else torch.float32


def _threads(numel: int) -> int:
    return _lib.num_threads() if numel >= PARALLEL_MIN_ELEMENTS else 1


def _unary(name: str, x: torch.Tensor) -> torch.Tensor:
    _check(x)
    dtype = result_dtype(name, x.dtype)
    x = x.to(dtype).contiguous()
    y = _lib.output(x.shape, dtype)
    if x.numel():
        suffix = "f64" if dtype == torch.float64 else "f32"
        _lib.kernel(f"{name}_{suffix}")(_lib.ptr(x), _lib.ptr(y), x.numel(), _threads(x.numel()))
    return y


def _binary(name: str, grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    grad, other = _f32(grad), _f32(other)
    if grad.shape != other.shape:
        raise ValueError(f"{name}: grad {tuple(grad.shape)} and its input {tuple(other.shape)} must have one shape")
    out = _lib.output(grad.shape, torch.float32)
    if grad.numel():
        _lib.kernel(f"{name}_f32")(_lib.ptr(grad), _lib.ptr(other), _lib.ptr(out), grad.numel(), _threads(grad.numel()))
    return out


def _row_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., n] as float32 rows [M, n] with a contiguous last dim (a view when it is one)."""
    x2 = (x if x.dtype == torch.float32 else x.to(torch.float32)).reshape(-1, n)
    return x2 if x2.stride(-1) == 1 or n <= 1 else x2.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, float32 [..., N], forward only (SwiGLU's product): silu's bits, then one
    IEEE multiply, in one pass (pointwise.cpp's silu_mul; every non-NaN element bitwise
    `silu(gate) * up`, NaNs canonical). gate and up of one shape; each may be a strided view whose
    rows have a contiguous last dim (the halves of one fused gate/up matrix are read in place)."""
    _check(gate), _check(up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    n = gate.shape[-1] if gate.dim() else 1
    g2, u2 = _row_view(gate, n), _row_view(up, n)
    m = g2.shape[0]
    y = _lib.output(gate.shape, torch.float32)
    if m and n:
        _lib.kernel("silu_mul_f32")(
            _lib.ptr(g2), _lib.ptr(u2), _lib.ptr(y), m, n, g2.stride(0), u2.stride(0), _threads(m * n)
        )
    return y


def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) of y = silu(gate) * up for grad [..., N], float32: the bits of the
    multiply's backward (grad * up, grad * silu(gate)) followed by `silu_backward`, in one pass
    (pointwise.cpp's silu_mul_backward; NaNs canonical). gate and up as in `silu_mul`."""
    _check(grad), _check(gate), _check(up)
    if not grad.shape == gate.shape == up.shape:
        raise ValueError(
            f"silu_mul_backward: grad {tuple(grad.shape)}, gate {tuple(gate.shape)} and up {tuple(up.shape)} "
            "must have one shape"
        )
    n = gate.shape[-1] if gate.dim() else 1
    d2, g2, u2 = _f32(grad).reshape(-1, n), _row_view(gate, n), _row_view(up, n)
    m = g2.shape[0]
    grad_gate, grad_up = _lib.output(gate.shape, torch.float32), _lib.output(gate.shape, torch.float32)
    if m and n:
        _lib.kernel("silu_mul_backward_f32")(
            _lib.ptr(d2),
            _lib.ptr(g2),
            _lib.ptr(u2),
            _lib.ptr(grad_gate),
            _lib.ptr(grad_up),
            m,
            n,
            g2.stride(0),
            u2.stride(0),
            _threads(m * n),
        )
    return grad_gate, grad_up


def _fake(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _make_unary(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def impl(x: torch.Tensor) -> torch.Tensor:
        return _unary(name, x)

    def fake(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=result_dtype(name, x.dtype), device=x.device)

    op = torch.library.custom_op(f"titan_audit::{name}", mutates_args=())(impl)
    op.register_fake(fake)

    def call(x: torch.Tensor) -> torch.Tensor:
        return op(x) if torch.compiler.is_compiling() else _unary(name, x)

    call.__name__ = name
    result = "float64 result for float64, else float32" if name in FLOAT64 else "float32 result"
    call.__doc__ = f"{name} of a float tensor, element by element ({result}); see the module doc."
    return call


def _make_binary(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def impl(grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return _binary(name, grad, other)

    op = torch.library.custom_op(f"titan_audit::{name}", mutates_args=())(impl)
    op.register_fake(_fake)

    def call(grad: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return op(grad, other) if torch.compiler.is_compiling() else _binary(name, grad, other)

    call.__name__ = name
    call.__doc__ = f"{name}(grad, saved) element by element (float32 result); see the module doc."
    return call


exp = _make_unary("exp")
exp2 = _make_unary("exp2")
log = _make_unary("log")
sqrt = _make_unary("sqrt")  # correctly rounded; torch.sqrt takes MKL VML, whose path depends on the CPU vendor
sigmoid = _make_unary("sigmoid")
silu = _make_unary("silu")
sigmoid_backward = _make_binary("sigmoid_backward")  # (grad, sigmoid's output y)
silu_backward = _make_binary("silu_backward")  # (grad, silu's input x)

__all__ = [
    "FLOAT64",
    "exp",
    "exp2",
    "log",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "silu_mul",
    "silu_mul_backward",
    "result_dtype",
    "sqrt",
]
