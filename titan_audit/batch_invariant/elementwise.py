"""Elementwise math of batch-invariant mode on CPU: the aten ops whose native kernels the CPU
vendor's library chooses, sent to our kernels or to exact IEEE operations.

Guarantee: while BI mode is on, these aten ops on a CPU tensor give the same bits on every CPU,
wherever an element sits in its tensor:
- exp, log, sqrt (float32, and float64 where the backend has it: the CPU's): the backend's kernels
  (`cpu.pointwise`; a test's forced Triton backend: `gpu.pointwise`, the same sequences). Torch's run
  MKL's VML on CPU tensors, which picks its code path by CPU vendor (on an AMD EPYC `sSqrt` is
  built on the approximate `rsqrtps` and is 1 ulp off on ~17% of inputs; on an Intel AVX-512
  Xeon on ~0.6%), and no knob (MKL_CBWR, MKL_ENABLE_INSTRUCTIONS) moves the AMD path.
- rsqrt = 1 / sqrt(x) (two correctly rounded operations).
- pow(x, scalar e): e in {0, 1, 2, 3, -1, -2} as the products and reciprocals ATen itself uses for
  them, e = 0.5 our sqrt, e = -0.5 1 / sqrt; any other exponent runs natively and is counted by the
  census (or refused under strict).
- sigmoid, silu and their backward (float32 and lower): our kernels (the models' own choice,
  `models/pointwise.py`); float64 runs natively and is counted.
- add / sub with alpha != 1: `a + (b * alpha)`, two roundings (ATen's vector code fuses them into
  one FMA on AVX2/AVX-512 and not in its scalar build); alpha == 1 is one correctly rounded add.
Other dtypes: bfloat16/float16 compute in float32 and round once; integer inputs of exp/log/sqrt
are promoted to the default float dtype as torch does; complex inputs run natively and are counted.

Registered at the CPU key (below autograd, so autograd's formulas call these too) by `mode.py`;
each route calls the backend of its tensor (`backend_for`: the CPU kernels, or the Triton ones
under a test's `forced("triton")`). On CUDA tensors these aten ops keep CUDA's native kernels:
each element is one device function of its own value (no vector body and scalar tail), so they
are position independent and deterministic on one GPU model; the model's own silu / sigmoid / exp
and the optimizer's sqrt call the backend directly (`models/pointwise.py`, `trainer/optim.py`) and
run the Triton kernels there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from titan_audit.batch_invariant import census
from titan_audit.batch_invariant.backend import backend_for


def _kernel_input(x: torch.Tensor) -> torch.Tensor | None:
    """x as our kernels take it, or None when it must run natively (complex)."""
    if x.is_complex():
        return None
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _apply(name: str, x: torch.Tensor) -> torch.Tensor | None:
    """Our kernel `name` on x, rounded to x's (floating) dtype; None when the census must see a
    native call instead (complex, or float64 for a kernel without a float64 version)."""
    xin = _kernel_input(x)
    if xin is None:
        return None
    backend = backend_for(xin)
    if xin.dtype == torch.float64 and name not in backend.FLOAT64_POINTWISE:
        return None
    y = getattr(backend, name)(xin)
    return y if y.dtype == xin.dtype else y.to(xin.dtype)


def _write_out(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if out.shape != value.shape:
        out.resize_(value.shape)
    return out.copy_(value)


def _three_forms(
    functional: str,
    inplace: str,
    out_form: str | None,
    compute: Callable[..., torch.Tensor | None],
    reason: Callable[..., str],
) -> dict[str, Callable[..., Any]]:
    """Routes for an op's functional, in-place and (if named) `.out` overloads: `compute(x, *scalars)`
    gives the result, or None to run the native kernel, counted by the census (a floating or
    complex input) with `reason(x, *scalars)`."""

    def native(op: str, keyset: Any, x: torch.Tensor, scalars: tuple, **out: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() or x.is_complex():
            census.note(f"aten::{op}", reason(x, *scalars))
        return census.original(f"aten::{op}")(keyset, x, *scalars, **out)

    def functional_route(keyset: Any, x: torch.Tensor, *scalars: Any) -> torch.Tensor:
        y = compute(x, *scalars)
        return native(functional, keyset, x, scalars) if y is None else y

    def inplace_route(keyset: Any, x: torch.Tensor, *scalars: Any) -> torch.Tensor:
        y = compute(x, *scalars)
        return native(inplace, keyset, x, scalars) if y is None else x.copy_(y)

    def out_route(keyset: Any, x: torch.Tensor, *scalars: Any, out: torch.Tensor) -> torch.Tensor:
        y = compute(x, *scalars)
        return native(out_form, keyset, x, scalars, out=out) if y is None else _write_out(out, y.to(out.dtype))

    table = {functional: functional_route, inplace: inplace_route}
    if out_form is not None:
        table[out_form] = out_route
    return table


def _dtype_reason(x: torch.Tensor, *scalars: Any) -> str:
    return f"dtype {x.dtype}"


def _exponent_reason(x: torch.Tensor, exponent: Any) -> str:
    return f"exponent={exponent!r}"


def _rsqrt(x: torch.Tensor) -> torch.Tensor | None:
    y = _apply("sqrt", x)
    return None if y is None else torch.reciprocal(y)


def _pow_scalar(x: torch.Tensor, exponent: Any) -> torch.Tensor | None:
    """x ** exponent by exact operations or our sqrt (module doc); None: run natively."""
    if not x.is_floating_point() or isinstance(exponent, complex) or isinstance(exponent, bool):
        return None  # integer powers are exact (and not counted); complex runs natively (counted)
    e = float(exponent)
    if e == 0:
        return torch.ones_like(x)
    if e == 1:
        return x.clone()
    if e == 2:
        return x * x
    if e == 3:
        return x * x * x
    if e == -1:
        return torch.reciprocal(x)
    if e == -2:
        return torch.reciprocal(x * x)
    if e == 0.5:
        return _apply("sqrt", x)
    if e == -0.5:
        return _rsqrt(x)
    return None


def _backward_route(name: str) -> Callable[..., Any]:
    """sigmoid_backward(grad, output) / silu_backward(grad, input) on our float32 kernels."""
    op = f"aten::{name}"

    def route(keyset: Any, grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        if grad.dtype == torch.float64 or saved.dtype == torch.float64 or grad.is_complex():
            census.note(op, f"dtype {grad.dtype}")
            return census.original(op)(keyset, grad, saved)
        return getattr(backend_for(grad, saved), name)(grad, saved).to(grad.dtype)

    return route


def _alpha_routes(name: str) -> dict[str, Callable[..., Any]]:
    """add/sub: alpha == 1 runs the native kernel (one correctly rounded add); other alphas as
    a +- (b * alpha) (module doc)."""
    routes = {}
    for overload in (f"{name}.Tensor", f"{name}_.Tensor", f"{name}.out"):
        op = f"aten::{overload}"
        out_form = overload.endswith(".out")

        def route(
            keyset: Any,
            a: torch.Tensor,
            b: Any,
            *,
            alpha: Any = 1,
            out: torch.Tensor | None = None,
            _op: str = op,
            _out_form: bool = out_form,
        ) -> torch.Tensor:
            kernel = census.original(_op)
            if alpha == 1 and isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor):
                # the common case (a residual add, autograd accumulating a gradient): as it came
                return kernel.tensors_only(keyset, a, b, **({"out": out} if _out_form else {}))
            if alpha != 1 and (census.floating(a) or census.floating(b)):
                b = torch.mul(b, alpha)  # exact op; then the add/sub with alpha 1
            elif alpha != 1:
                return kernel(keyset, a, b, alpha=alpha, **({"out": out} if _out_form else {}))
            return kernel(keyset, a, b, **({"out": out} if _out_form else {}))

        routes[overload] = route
    return routes


def routes() -> dict[str, Callable[..., Any]]:
    """CPU-key routes ('name.overload' -> kernel taking the dispatch keyset first)."""
    table: dict[str, Callable[..., Any]] = {}
    for name in ("exp", "log", "sqrt", "sigmoid", "silu"):
        table.update(_three_forms(name, f"{name}_", f"{name}.out", functools.partial(_apply, name), _dtype_reason))
    table.update(_three_forms("rsqrt", "rsqrt_", None, _rsqrt, _dtype_reason))
    table.update(
        _three_forms("pow.Tensor_Scalar", "pow_.Scalar", "pow.Tensor_Scalar_out", _pow_scalar, _exponent_reason)
    )
    table["sigmoid_backward"] = _backward_route("sigmoid_backward")
    table["silu_backward"] = _backward_route("silu_backward")
    table.update(_alpha_routes("add"))
    table.update(_alpha_routes("sub"))
    return table
