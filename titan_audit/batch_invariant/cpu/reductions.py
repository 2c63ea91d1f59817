"""CPU row reductions (sum, sum of squares, softmax, log_softmax, rms_norm and their backward) on
our own compiled kernels (`kernels/rowops.cpp`), with a reduction order fixed by the row length
alone.

Guarantee: a row's result is a fixed sequence of IEEE operations on that row (and the shared
weight), the same bits whatever the number of rows, the thread count or the ISA variant
(`_lib.forced_isa`). The order, written next to each kernel in rowops.cpp:
- a sum along a row: 16 lanes, lane l adds elements l, l+16, ... in ascending order from -0.0,
  then the fixed tree `ta::tree16` (AVX-512: one zmm, AVX2: two ymm, scalar: 16 floats);
- the row max: exact (a select per lane, NaN skipped, `+ 0.0` so a zero max is +0.0);
- exp / log: `ta::exp_f32` / `ta::log_f32` (ta_math.h, float64: `exp_f64` / `log_f64`);
- threads split rows; rms_norm's weight gradient (a sum over rows) is split by columns, each
  column adding its rows in ascending order: deterministic, but it depends on which rows are in
  the batch, as every weight gradient must;
- `sum_dims` over leading dims (a weight's gradient summed over batch and tokens) runs down the
  columns (`col_sum`: column c's values in the lane order above, vector lanes across columns),
  the bits of moving the dims last and summing rows, without that transposed copy;
  `sum_squares_dims` adds each element's rounded square (the bits of `sum_dims(x * x)` without
  the temporary, for `linalg.vector_norm`).

Dtypes: float32 compute; bfloat16/float16 are upcast (exactly) to float32; float64 runs the
float64 kernels of the same order. Results are in the compute dtype; callers round them once.

Every function is also a `torch.library` custom op (`titan_audit::softmax`, ...) with a fake
(meta) implementation, used while `torch.compile` traces, so compiled code keeps the kernels.
Eager calls skip the custom-op dispatcher and call the kernel directly (the same function, the
same bits).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Optional

import torch

from titan_audit.batch_invariant.cpu import _lib

PARALLEL_MIN_ELEMENTS = 1 << 15  # below this one thread does the call (threads never change bits)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
for _sfx in ("f32", "f64"):
    for _sum in ("row_sum", "row_sum_sq", "col_sum", "col_sum_sq"):
        _lib.declare(f"{_sum}_{_sfx}", None, [_P, _P, _I64, _I64, _INT])
    _lib.declare(f"softmax_{_sfx}", None, [_P, _P, _I64, _I64, _INT])
    _lib.declare(f"log_softmax_{_sfx}", None, [_P, _P, _I64, _I64, _INT])
    _lib.declare(f"softmax_backward_{_sfx}", None, [_P, _P, _P, _I64, _I64, _INT])
    _lib.declare(f"log_softmax_backward_{_sfx}", None, [_P, _P, _P, _I64, _I64, _INT])
    _lib.declare(f"rms_norm_{_sfx}", None, [_P, _P, _P, _P, _I64, _I64, ctypes.c_double, _INT])
    _lib.declare(f"rms_norm_backward_{_sfx}", None, [_P, _P, _P, _P, _P, _P, _I64, _I64, _INT])
    _lib.declare(f"rms_norm_scaled_backward_{_sfx}", None, [_P, _P, _P, _P, _P, _P, _I64, _I64, _INT])
    _lib.declare(f"add_rms_norm_{_sfx}", None, [_P, _P, _P, _P, _P, _I64, _I64, ctypes.c_double, _INT])
    _lib.declare(f"rms_norm_rope_{_sfx}", None, [_P] * 5 + [_I64] * 5 + [ctypes.c_double, _INT])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, contiguous (a copy only when needed)."""
    return x.to(dtype).contiguous()


def _threads(numel: int) -> int:
    return _lib.num_threads() if numel >= PARALLEL_MIN_ELEMENTS else 1


def _shape_mn(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


# ---------------------------------------------------------------- kernels (eager)


def _row_sum(x: torch.Tensor, kernel: str = "sum") -> torch.Tensor:
    """Sum over the last dim (dropped), lanes + tree16, of x ("sum") or of its squares ("sum_sq")."""
    x = _rows(x, compute_dtype(x.dtype))
    m, n = _shape_mn(x)
    out = torch.zeros(x.shape[:-1], dtype=x.dtype)
    if m and n:
        _lib.kernel(f"row_{kernel}_{_suffix(x.dtype)}")(_lib.ptr(x), _lib.ptr(out), m, n, _threads(x.numel()))
    return out


def _row_map(name: str, x: torch.Tensor) -> torch.Tensor:
    x = _rows(x, compute_dtype(x.dtype))
    m, n = _shape_mn(x)
    y = _lib.output(x.shape, x.dtype)
    if m and n:
        _lib.kernel(f"{name}_{_suffix(x.dtype)}")(_lib.ptr(x), _lib.ptr(y), m, n, _threads(x.numel()))
    return y


def _row_backward(name: str, grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = compute_dtype(y.dtype)
    grad, y = _rows(grad, dtype), _rows(y, dtype)
    if grad.shape != y.shape:
        raise ValueError(f"{name}: grad {tuple(grad.shape)} and output {tuple(y.shape)} must have one shape")
    m, n = _shape_mn(y)
    out = _lib.output(y.shape, dtype)
    if m and n:
        _lib.kernel(f"{name}_{_suffix(dtype)}")(_lib.ptr(grad), _lib.ptr(y), _lib.ptr(out), m, n, _threads(y.numel()))
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = compute_dtype(x.dtype)
    x = _rows(x, dtype)
    w = None if weight is None else _rows(weight, dtype)
    m, n = _shape_mn(x)
    y = _lib.output(x.shape, dtype)
    rstd = _lib.output((*x.shape[:-1], 1), dtype)
    if m and n:
        _lib.kernel(f"rms_norm_{_suffix(dtype)}")(
            _lib.ptr(x),
            None if w is None else _lib.ptr(w),
            _lib.ptr(y),
            _lib.ptr(rstd),
            m,
            n,
            float(eps),
            _threads(x.numel()),
        )
    return y, rstd


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y) with s = h + delta and y = rms_norm(s) * weight (the `rms_norm` kernel's y), in
    compute dtype, forward only: a residual add and the norm after it in one pass (rowops.cpp's
    add_rms_norm; every non-NaN element bitwise the two calls', NaNs canonical). h and delta of
    one shape, weight [N]."""
    dtype = compute_dtype(h.dtype)
    h, delta, w = _rows(h, dtype), _rows(delta, dtype), _rows(weight, dtype)
    m, n = _shape_mn(h)
    s = _lib.output(h.shape, dtype)
    y = _lib.output(h.shape, dtype)
    if m and n:
        _lib.kernel(f"add_rms_norm_{_suffix(dtype)}")(
            _lib.ptr(h), _lib.ptr(delta), _lib.ptr(w), _lib.ptr(s), _lib.ptr(y), m, n, float(eps), _threads(h.numel())
        )
    return s, y


def rms_norm_rope(
    x_NHd: torch.Tensor, weight_Hd: torch.Tensor, cos_Nd: torch.Tensor, sin_Nd: torch.Tensor, eps: float
) -> torch.Tensor:
    """q/k-norm then RoPE, forward only (rowops.cpp's rms_norm_rope): per token n and head h,
    rms_norm(x[n, h]) * weight[h] rotated by cos[n] / sin[n] (rotate-half), [N, H, d] in compute
    dtype; every non-NaN element bitwise `rms_norm` (no weight), the weight multiply and
    models/rope.py's `apply_rope`, NaNs canonical. x's heads may be a strided view of a wider
    projection (its token stride is passed); weight_Hd may be an expanded [d] (head stride 0)."""
    dtype = compute_dtype(x_NHd.dtype)
    tokens, heads, d = x_NHd.shape
    x = x_NHd.to(dtype)
    if x.stride(2) != 1 or x.stride(1) != d:
        x = x.contiguous()
    w = weight_Hd.to(dtype)
    if w.stride(1) != 1:
        w = w.contiguous()
    cos, sin = _rows(cos_Nd, dtype), _rows(sin_Nd, dtype)
    y = _lib.output((tokens, heads, d), dtype)
    if tokens and heads and d:
        _lib.kernel(f"rms_norm_rope_{_suffix(dtype)}")(
            _lib.ptr(x),
            _lib.ptr(w),
            _lib.ptr(cos),
            _lib.ptr(sin),
            _lib.ptr(y),
            tokens,
            heads,
            d,
            x.stride(0),
            w.stride(0),
            float(eps),
            _threads(y.numel()),
        )
    return y


def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = rstd.dtype
    grad, x, rstd = _rows(grad, dtype), _rows(x, dtype), _rows(rstd, dtype)
    w = None if weight is None else _rows(weight, dtype)
    m, n = _shape_mn(x)
    grad_x = _lib.output(x.shape, dtype)
    grad_w = None if w is None else torch.zeros(n, dtype=dtype)
    if m and n:
        _lib.kernel(f"rms_norm_backward_{_suffix(dtype)}")(
            _lib.ptr(grad),
            _lib.ptr(x),
            None if w is None else _lib.ptr(w),
            _lib.ptr(rstd),
            _lib.ptr(grad_x),
            None if grad_w is None else _lib.ptr(grad_w),
            m,
            n,
            _threads(x.numel()),
        )
    return grad_x, grad_w


def rms_norm_scaled_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of y = weight * (x * rstd), the weight applied after the norm: the
    bits of that multiply's backward (grad * weight into the norm's backward; grad * normed summed
    over the rows in `sum_dims`'s order for the weight) in one kernel (rowops.cpp
    rms_norm_scaled_backward). Eager only (the caller composes the ops while compiling)."""
    dtype = rstd.dtype
    grad, x, rstd, w = _rows(grad, dtype), _rows(x, dtype), _rows(rstd, dtype), _rows(weight, dtype)
    m, n = _shape_mn(x)
    grad_x = _lib.output(x.shape, dtype)
    grad_w = torch.zeros(n, dtype=dtype)
    if m and n:
        _lib.kernel(f"rms_norm_scaled_backward_{_suffix(dtype)}")(
            _lib.ptr(grad),
            _lib.ptr(x),
            _lib.ptr(w),
            _lib.ptr(rstd),
            _lib.ptr(grad_x),
            _lib.ptr(grad_w),
            m,
            n,
            _threads(x.numel()),
        )
    return grad_x, grad_w


def _last_dim_first(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Move `dims` to the end and flatten them into one last dim (row-major order of the dims)."""
    rest = [d for d in range(x.dim()) if d not in dims]
    x = x.permute(*rest, *dims)
    return x.reshape(*x.shape[: len(rest)], -1)


def _sum_dims(x: torch.Tensor, dims: list[int], keepdim: bool, kernel: str = "sum") -> torch.Tensor:
    """Sum of x (kernel "sum") or of its squares ("sum_sq") over `dims`, in the row order of
    `_last_dim_first`. Leading dims with the rest kept are the columns of a [M, N] view: summed
    down the columns in place (the same order per output), else the dims are moved last."""
    dims = sorted(dims)
    if x.dim() and len(dims) < x.dim() and dims == list(range(len(dims))):
        x = _rows(x, compute_dtype(x.dtype))
        kept = x.shape[len(dims) :]
        out = torch.empty(kept, dtype=x.dtype)
        n = out.numel()
        m = x.numel() // n if n else 0
        if n:
            if m:
                _lib.kernel(f"col_{kernel}_{_suffix(x.dtype)}")(_lib.ptr(x), _lib.ptr(out), m, n, _threads(x.numel()))
            else:
                out.zero_()
    else:
        out = _row_sum(_last_dim_first(x, dims) if x.dim() else x.reshape(1), kernel)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


# ---------------------------------------------------------------- custom ops (torch.compile)


def _fake_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=compute_dtype(x.dtype), device=x.device)


@torch.library.custom_op("titan_audit::sum_dims", mutates_args=())
def _sum_dims_op(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return _sum_dims(x, dims, keepdim)


@_sum_dims_op.register_fake
def _(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    shape = (
        [1 if d in dims else s for d, s in enumerate(x.shape)]
        if keepdim
        else [s for d, s in enumerate(x.shape) if d not in dims]
    )
    return torch.empty(shape, dtype=compute_dtype(x.dtype), device=x.device)


def _unary_op(name: str, kernel_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    op = torch.library.custom_op(f"titan_audit::{name}", mutates_args=())(
        _typed_unary(lambda x: _row_map(kernel_name, x))
    )
    op.register_fake(_fake_like)
    return op


def _binary_op(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    op = torch.library.custom_op(f"titan_audit::{name}", mutates_args=())(
        _typed_binary(lambda grad, y: _row_backward(name, grad, y))
    )
    op.register_fake(lambda grad, y: _fake_like(y))
    return op


def _typed_unary(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def impl(x: torch.Tensor) -> torch.Tensor:
        return f(x)

    return impl


def _typed_binary(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def impl(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return f(grad, y)

    return impl


_softmax_op = _unary_op("softmax", "softmax")
_log_softmax_op = _unary_op("log_softmax", "log_softmax")
_softmax_backward_op = _binary_op("softmax_backward")
_log_softmax_backward_op = _binary_op("log_softmax_backward")


@torch.library.custom_op("titan_audit::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    return _rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045
    dtype = compute_dtype(x.dtype)
    return _fake_like(x), torch.empty(*x.shape[:-1], 1, dtype=dtype, device=x.device)


@torch.library.custom_op("titan_audit::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = _rms_norm_backward(grad, x, weight, rstd)
    return grad_x, grad_x.new_empty(0) if grad_w is None else grad_w


@_rms_norm_backward_op.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: UP045, E501
    return (
        torch.empty(x.shape, dtype=rstd.dtype, device=x.device),
        torch.empty(0 if weight is None else x.shape[-1], dtype=rstd.dtype, device=x.device),
    )


# ---------------------------------------------------------------- the backend functions


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16 lanes + tree16), in compute dtype; the result drops the last dim."""
    if torch.compiler.is_compiling():
        return _sum_dims_op(x, [x.dim() - 1], False)
    return _row_sum(x)


def sum_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Sum over `dims` (normalised, distinct) in compute dtype, one row per kept index: the dims
    flattened in row-major order and summed by the lanes + tree16 order."""
    if torch.compiler.is_compiling():
        return _sum_dims_op(x, sorted(dims), keepdim)
    return _sum_dims(x, dims, keepdim)


def sum_squares_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """`sum_dims(x * x, dims, keepdim)` bit for bit for float32 / float64 x (each square rounded
    in x's dtype, then summed in the same order), without the x * x temporary."""
    assert x.dtype in (torch.float32, torch.float64), x.dtype
    if torch.compiler.is_compiling():
        return _sum_dims_op(x * x, sorted(dims), keepdim)
    return _sum_dims(x, dims, keepdim, "sum_sq")


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in compute dtype (fused: max, exp + sum, scale)."""
    return _softmax_op(x) if torch.compiler.is_compiling() else _row_map("softmax", x)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim, in compute dtype: (x - max) - log(sum exp(x - max))."""
    return _log_softmax_op(x) if torch.compiler.is_compiling() else _row_map("log_softmax", x)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d softmax: y * (g - sum(g * y)), the row sum in the lanes + tree16 order."""
    return (
        _softmax_backward_op(grad, y) if torch.compiler.is_compiling() else _row_backward("softmax_backward", grad, y)
    )


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d log_softmax: g - exp(y) * sum(g) (one fma), the row sum in the lanes + tree16 order."""
    if torch.compiler.is_compiling():
        return _log_softmax_backward_op(grad, y)
    return _row_backward("log_softmax_backward", grad, y)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) with rstd = 1 / sqrt(sum(x^2) / N + eps) over the last dim (rstd [..., 1]) and
    y = (x * rstd) * weight, in compute dtype (fused: one pass for the sum, one for y)."""
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, float(eps))
    return _rms_norm(x, weight, eps)


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x, grad_weight). grad_x per row (its row sum in the lanes + tree16 order);
    grad_weight sums over rows, per column in ascending row order (deterministic)."""
    if torch.compiler.is_compiling():
        grad_x, grad_w = _rms_norm_backward_op(grad, x, weight, rstd)
        return grad_x, None if weight is None else grad_w
    return _rms_norm_backward(grad, x, weight, rstd)
