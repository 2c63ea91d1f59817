"""Our float64 exp / log / sqrt kernels (cpu/kernels/pointwise.cpp exp_f64, log_f64, sqrt_f64 on
ta_math.h's exp_f64 / log_f64 and IEEE sqrt) and their routing in `cpu/pointwise.py`.

Proves: float64 in -> float64 kernel and float64 out (the custom op's fake agrees), every other
floating dtype keeps the float32 path; an element's bits depend on its value alone (alone, in a
slice at any offset, at 1 and 2 threads, on every ISA variant the CPU has); the special values
(+-0, +-inf, NaN as the one canonical NaN, subnormal inputs and results, the overflow and
underflow boundaries); accuracy against a reference with more precision (numpy's long double when
it has a 64-bit mantissa, else mpmath): exp within 1 ulp, log within 3 ulp (0.90 / 2.93 measured,
ta_math.h), sqrt correctly rounded. Inputs are built from integers (numpy bit patterns), so the
same test sees the same inputs on every CPU.
Negative control: a log with one more rounding (-log(1 / x), our log of the rounded reciprocal)
differs from ours, so the cross-variant comparisons here can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from batch_invariant._helpers import num_threads

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu import pointwise as P

F64 = {"exp": P.exp, "log": P.log, "sqrt": P.sqrt}
INF, NAN = float("inf"), float("nan")
CANON_NAN = 0x7FF8000000000000
SPECIAL = [
    0.0,
    -0.0,
    INF,
    -INF,
    NAN,
    -NAN,
    1.0,
    -1.0,
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    2.225073858507201e-308,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    709.782712893384,
    709.7827128933841,
    710.0,
    -708.3964185322641,
    -745.1332191019411,
    -745.1332191019412,
    -746.0,
    0.5,
    2.0,
    math.sqrt(2.0),
    1.0 + 2.0**-52,
    1.0 - 2.0**-53,
    1e-300,
    1e300,
]


def _bits(n: int, seed: int) -> np.ndarray:
    """n uint64 words from splitmix64 (integer arithmetic only)."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _from_bits(u: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(u.copy()).view(torch.float64)


def _uniform(n: int, seed: int, lo: float, hi: float) -> torch.Tensor:
    """n float64 in [lo, hi): 53 random bits scaled exactly, then one affine map."""
    u = (_bits(n, seed) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return torch.from_numpy(lo + u * (hi - lo))


def _inputs(name: str) -> torch.Tensor:
    """Every finite and non-finite pattern (random bits), the special values, the function's
    interesting range, and subnormals."""
    parts = [_from_bits(_bits(4099, seed=1)), torch.tensor(SPECIAL, dtype=torch.float64)]
    if name == "exp":
        parts.append(_uniform(5003, 2, -746.0, 711.0))
    else:
        parts.append(_uniform(5003, 3, 0.0, 4.0))
    parts.append(_from_bits(_bits(777, seed=4) & np.uint64(0x800FFFFFFFFFFFFF)))  # subnormals and zeros
    return torch.cat(parts)


def _u64(t: torch.Tensor) -> list[int]:
    return [v & (2**64 - 1) for v in t.view(torch.int64).tolist()]


def test_float64_in_float64_out_and_other_dtypes_keep_float32() -> None:
    x = torch.tensor([0.25, 1.5, 3.0], dtype=torch.float64)
    for name, f in F64.items():
        assert f(x).dtype == torch.float64, name
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = f(x.to(dtype))
            assert y.dtype == torch.float32, (name, dtype)
            assert_bitwise_equal(y, f(x.to(dtype).float()), f"{name} of {dtype} is the float32 kernel")
    for name in ("exp2", "sigmoid", "silu"):
        assert getattr(P, name)(x).dtype == torch.float32, name  # no float64 kernel: float32 as before


@pytest.mark.parametrize("name", sorted(F64))
def test_every_isa_variant_gives_the_same_bits(name: str) -> None:
    x = _inputs(name)
    results = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            results[isa] = F64[name](x)
    assert "scalar" in results
    for isa, y in results.items():
        assert_bitwise_equal(y, results["scalar"], f"{name}_f64: {isa} vs scalar")


@pytest.mark.parametrize("name", sorted(F64))
def test_bits_do_not_depend_on_position_length_or_threads(name: str) -> None:
    x = _inputs(name)
    whole = F64[name](x)
    for offset, n in ((0, 1), (1, 7), (3, 15), (5, 17), (9, 33), (13, 1023), (2, x.numel() - 2)):
        assert_bitwise_equal(F64[name](x[offset : offset + n]), whole[offset : offset + n], f"{name} [{offset}:+{n}]")
    alone = torch.cat([F64[name](x[i : i + 1]) for i in range(0, x.numel(), 101)])
    assert_bitwise_equal(alone, whole[::101], f"{name} element by element")
    long = _uniform(200_003, 5, -700.0, 700.0) if name == "exp" else _uniform(200_003, 6, 0.0, 1e6)
    with num_threads(1):
        one = F64[name](long)
    with num_threads(2):
        two = F64[name](long)
    assert_bitwise_equal(two, one, f"{name} at 2 threads")


def test_special_values() -> None:
    d = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    e = P.exp(d(0.0, -0.0, -INF, INF, 710.0, 709.78, -745.14, -745.13, -746.0, 1e-320, -1e-320))
    assert e[:4].tolist() == [1.0, 1.0, 0.0, INF] and _u64(e[2:3]) == [0]  # exp(-inf) = +0
    assert e[4].item() == INF and math.isfinite(e[5].item()) and e[5].item() > 1.7e308
    assert e[6].item() == 0.0 and e[7].item() == 5e-324 and e[8].item() == 0.0  # the subnormal boundary
    assert e[9].item() == 1.0 and e[10].item() == 1.0
    lg = P.log(d(0.0, -0.0, -1.0, -INF, INF, 1.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308))
    assert lg[:2].tolist() == [-INF, -INF] and lg[4].item() == INF and _u64(lg[5:6]) == [0]  # log(1) = +0
    assert lg[6].item() == pytest.approx(-1074 * math.log(2), rel=1e-15)  # smallest subnormal
    assert lg[7].item() == pytest.approx(-1022 * math.log(2), rel=1e-15)
    assert lg[8].item() == pytest.approx(math.log(1.7976931348623157e308), rel=1e-15)
    s = P.sqrt(d(0.0, -0.0, INF, 4.0, 5e-324, -1.0, -INF))
    assert _u64(s[:2]) == [0, 1 << 63] and s[2].item() == INF and s[3].item() == 2.0  # sqrt(-0) = -0
    assert s[4].item() == math.sqrt(5e-324)
    # every NaN result is the one canonical quiet NaN, whatever the input NaN's sign and payload
    nans = _from_bits(
        np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0xFFF4000000000123], dtype=np.uint64)
    )
    for name, f in F64.items():
        assert _u64(f(nans)) == [CANON_NAN] * 4, name
    assert _u64(lg[2:4]) == [CANON_NAN] * 2 and _u64(s[5:7]) == [CANON_NAN] * 2


def _ulp64(ref: np.ndarray) -> np.ndarray:
    """The float64 spacing at |ref| (ref rounded to float64), subnormal spacing at the bottom."""
    r = np.abs(ref.astype(np.float64))
    _, e = np.frexp(r)
    return np.ldexp(1.0, np.maximum(e - 53, -1074))


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    """exp / log with more than float64 precision (as long double, or float64 via mpmath's error
    estimate)."""
    if np.finfo(np.longdouble).nmant >= 63:
        return getattr(np, name)(x.astype(np.longdouble))
    import mpmath

    mpmath.mp.prec = 113
    f = getattr(mpmath, name)
    return np.array([float(f(mpmath.mpf(float(v)))) for v in x], dtype=np.float64)  # pragma: no cover


def test_accuracy_against_a_more_precise_reference() -> None:
    cases = {
        "exp": torch.cat(
            [
                _uniform(400_000, 7, -745.13, 709.78),
                _uniform(50_000, 8, -1e-5, 1e-5),
                _uniform(50_000, 9, -745.13, -708.0),
            ]
        ),
        "log": torch.cat(
            [
                _uniform(200_000, 10, 0.99, 1.01),
                _uniform(100_000, 11, 0.69, 1.43),
                _from_bits(_bits(200_000, 12) & np.uint64(0x7FEFFFFFFFFFFFFF)),
                _from_bits((_bits(50_000, 13) & np.uint64(0x000FFFFFFFFFFFFF)) | np.uint64(1)),
            ]
        ),
    }
    bounds = {"exp": 1.0, "log": 3.0}
    for name, x in cases.items():
        xn = x.numpy()
        if np.finfo(np.longdouble).nmant < 63:
            xn = xn[:: max(1, xn.size // 20_000)]
            x = torch.from_numpy(xn.copy())
        ref = _reference(name, xn)
        y = F64[name](x).numpy()
        err = (np.abs(y.astype(np.longdouble) - ref) / _ulp64(ref)).astype(np.float64)
        assert err.max() <= bounds[name], f"{name}_f64: max {err.max():.3f} ulp at x = {xn[err.argmax()]!r}"
        assert err.max() > 0.5, f"{name}_f64: the reference is not more precise than float64?"
    x = torch.cat([_from_bits(_bits(300_000, 14) & np.uint64(0x7FEFFFFFFFFFFFFF)), _uniform(100_000, 15, 1.0, 4.0)])
    assert_bitwise_equal(P.sqrt(x), torch.from_numpy(np.sqrt(x.numpy())), "sqrt_f64 is IEEE's correctly rounded sqrt")


@pytest.mark.control
def test_negative_control_a_log_with_another_rounding_differs() -> None:
    """log(x) as -log(1 / x): our kernel on the reciprocal, which IEEE division rounds once more."""
    x = _uniform(10_000, 16, 0.1, 10.0)
    assert not bitwise_equal(-P.log(1.0 / x), P.log(x))


def test_custom_ops_keep_the_dtype_under_opcheck_and_fake_tensors() -> None:
    """The fake of titan_audit::exp/log/sqrt returns float64 for float64 (float32 otherwise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.titan_audit
    x = _uniform(300, 17, 0.1, 20.0)
    for name in F64:
        torch.library.opcheck(getattr(ops, name), (x,))
        torch.library.opcheck(getattr(ops, name), (x.float(),))
    with FakeTensorMode():
        fx = torch.empty(5, dtype=torch.float64)
        assert ops.exp(fx).dtype == ops.log(fx).dtype == ops.sqrt(fx).dtype == torch.float64
        assert ops.exp(fx.float()).dtype == ops.exp2(fx).dtype == torch.float32
