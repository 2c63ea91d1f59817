"""sum, mean, softmax, log_softmax and rms_norm (and the backward kernels) are row-invariant,
bitwise, the same on every ISA variant, in the order the kernels document, and accurate.

Proves:
- a row's result is the same bits alone, in any slice and in a batch of 1..512 rows, for random
  lengths (1..300: not multiples of 16, shorter and longer than the 16 lanes), float32 and
  bfloat16, at 1 and 2 threads (and 1 thread == 2 threads);
- every row kernel (forward and backward; float32, bfloat16 and float64) gives identical bits under every
  ISA variant the CPU has (`_lib.forced_isa`), the in-CI stand-in for other CPUs;
- the order is the documented one: the sum equals an emulation of "16 lanes, lane l adds
  elements l, l+16, ... in ascending order, then tree16" written with element-wise torch adds
  (each one IEEE rounding), and softmax equals max / our exp / that sum / one reciprocal;
- results are within float32 tolerance of float64 (float64 inputs: of torch's float64 ops);
- special values: -inf logits get exactly 0, a NaN reaches the whole row as the canonical NaN,
  an all -0.0 row sums to -0.0, a max of zeros is +0.0;
- torch.compile (fullgraph) keeps the kernels (custom ops) and gives the eager bits; every custom op
  passes torch.library.opcheck (schema, fake implementation, AOT tracing).
Negative controls: long rows each summed alone in two halves (what a kernel that splits a lone
row across threads does) give other sums and means than the same rows in the batch; a sequential
sum and an 8-lane sum differ from ours, so the row, order and cross-variant checks can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from batch_invariant._helpers import DTYPES, num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu import pointwise as P
from titan_audit.batch_invariant.cpu import reductions as R

OPS = {
    "sum": lambda x: bi.sum(x, dim=-1),
    "mean": lambda x: bi.mean(x, dim=-1, keepdim=True),
    "softmax": lambda x: bi.softmax(x, dim=-1),
    "log_softmax": lambda x: bi.log_softmax(x, dim=-1),
    "rms_norm": lambda x: bi.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[-1]).to(x.dtype)),
}


@pytest.mark.parametrize("op", sorted(OPS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_rows_do_not_depend_on_the_batch(op: str, data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 512), label="batch")
    n = data.draw(st.integers(1, 300), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x = randn(batch, n, seed=seed, dtype=dtype, scale=3.0)
    start = data.draw(st.integers(0, batch - 1), label="start")
    length = data.draw(st.integers(1, batch - start), label="length")
    f = OPS[op]
    with num_threads(threads):
        full = f(x)
        assert_bitwise_equal(f(x[start : start + length]), full[start : start + length], "slice")
        assert_bitwise_equal(f(x[start : start + 1]), full[start : start + 1], "single row")
    with num_threads(3 - threads):
        assert_bitwise_equal(f(x), full, "the other thread count")


def _kernel_results(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every row kernel of the backend on (x, g, w)."""
    y, rstd = R.rms_norm(x, w, 1e-5)
    gx, gw = R.rms_norm_backward(g, x, w, rstd)
    gx0, _ = R.rms_norm_backward(g, x, None, rstd)
    sm, lsm = R.softmax(x), R.log_softmax(x)
    return {
        "sum": R.tree_sum(x),
        "sum_dims": R.sum_dims(x, [0], True),
        "softmax": sm,
        "log_softmax": lsm,
        "softmax_backward": R.softmax_backward(g, sm),
        "log_softmax_backward": R.log_softmax_backward(g, lsm),
        "rms_norm": y,
        "rstd": rstd,
        "rms_norm_unweighted": R.rms_norm(x, None, 1e-5)[0],
        "rms_norm_grad_x": gx,
        "rms_norm_grad_w": gw,
        "rms_norm_grad_x_unweighted": gx0,
    }


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 512),
    n=st.integers(1, 200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_isa_variant_gives_the_same_bits(m: int, n: int, dtype: torch.dtype, threads: int, seed: int) -> None:
    x = randn(m, n, seed=seed, scale=4.0).to(dtype)
    g = randn(m, n, seed=seed + 1).to(dtype)
    w = randn(n, seed=seed + 2).to(dtype)
    results = {}
    with num_threads(threads):
        for isa in _lib.available_isas():
            with _lib.forced_isa(isa):
                results[isa] = _kernel_results(x, g, w)
    for isa, got in results.items():
        for name, t in got.items():
            assert_bitwise_equal(t, results["scalar"][name], f"{name}: {isa} vs scalar")


def test_isa_variants_agree_on_special_values() -> None:
    x = randn(8, 53, seed=3)
    x[0, 5], x[1, 0], x[2, :] = float("nan"), float("inf"), float("-inf")
    x[3, 7:20], x[4, :] = float("-inf"), -0.0
    x[5, 3] = 1e-42  # subnormal
    x[6] = torch.linspace(-160.0, 0.0, 53)  # exp underflows to subnormals and 0 (two-factor 2^n)
    x[7] = torch.cat([torch.zeros(1), torch.linspace(-100.0, -80.0, 52)])  # exps around the subnormal edge
    g = randn(8, 53, seed=4)
    results = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            results[isa] = _kernel_results(x, g, torch.ones(53))
            results[isa]["exp_wide"] = P.exp(x.reshape(-1))
    for isa, got in results.items():
        for name, t in got.items():
            assert_bitwise_equal(t, results["scalar"][name], f"{name} with special values: {isa} vs scalar")


def lane_sum_reference(x: torch.Tensor, lanes: int = 16) -> torch.Tensor:
    """The documented order, with element-wise torch adds: lane l adds elements l, l+lanes, ...
    ascending from -0.0, then the pairwise tree (lane i + lane i + lanes/2, ...)."""
    m, n = x.shape
    k = -(-n // lanes)
    padded = torch.full((m, k * lanes), -0.0, dtype=x.dtype)
    padded[:, :n] = x
    acc = torch.full((m, lanes), -0.0, dtype=x.dtype)
    for step in padded.view(m, k, lanes).unbind(1):
        acc = acc + step
    while acc.shape[1] > 1:
        half = acc.shape[1] // 2
        acc = acc[:, :half] + acc[:, half:]
    return acc[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 1000, 4099])
def test_sum_is_the_documented_lane_order(dtype: torch.dtype, n: int) -> None:
    x = randn(7, n, seed=n, scale=3.0).to(dtype)
    assert_bitwise_equal(bi.sum(x), lane_sum_reference(x), "16 lanes + tree16")


def test_softmax_is_max_exp_lane_sum_reciprocal() -> None:
    x = randn(5, 333, seed=11, scale=5.0)
    e = P.exp(x - x.amax(-1, keepdim=True))
    expected = e * (torch.ones(5, 1) / lane_sum_reference(e).unsqueeze(-1))
    assert_bitwise_equal(bi.softmax(x), expected, "softmax order")
    log_expected = (x - x.amax(-1, keepdim=True)) - P.log(lane_sum_reference(e)).unsqueeze(-1)
    assert_bitwise_equal(bi.log_softmax(x), log_expected, "log_softmax order")


@pytest.mark.control
def test_negative_control_other_lane_orders_differ() -> None:
    """A sequential sum (1 lane) and an 8-lane sum give other bits: a variant with another
    order would fail the checks above."""
    x = randn(64, 1000, seed=12)
    ours = bi.sum(x)
    assert not bitwise_equal(lane_sum_reference(x, lanes=1), ours)
    assert not bitwise_equal(lane_sum_reference(x, lanes=8), ours)
    assert_bitwise_equal(lane_sum_reference(x, lanes=16), ours)


def test_other_dims_and_3d() -> None:
    x = randn(5, 7, 33, seed=1)
    assert_bitwise_equal(bi.softmax(x, dim=1)[2], bi.softmax(x[2], dim=0))
    assert_bitwise_equal(bi.sum(x, dim=0), bi.sum(x.movedim(0, -1), dim=-1))
    assert_bitwise_equal(bi.log_softmax(x)[1:3], bi.log_softmax(x[1:3]))
    assert_bitwise_equal(R.sum_dims(x, [0, 2], False), lane_sum_reference(x.permute(1, 0, 2).reshape(7, -1)))


def _halves_sum(row: torch.Tensor) -> torch.Tensor:
    """The row's sum as two half-row sums added: another order of the same additions."""
    half = row.shape[-1] // 2
    return bi.sum(row[..., :half]) + bi.sum(row[..., half:])


@pytest.mark.control
def test_negative_control_long_rows_summed_alone_in_halves_differ() -> None:
    """The lone-row check can fail: each long row summed alone in two halves gives other bits than
    the batch's sum and mean of it, under the same comparison our ops pass for a lone row at 2
    threads. Native torch.sum is reported, not asserted: whether it splits a lone row depends on
    the CPU and the thread count."""
    x = randn(16, 100_000, seed=2)
    with num_threads(2):
        alone_in_halves = torch.cat([_halves_sum(x[i : i + 1]) for i in range(16)])
        assert not bitwise_equal(alone_in_halves, bi.sum(x)), "sum"
        assert not bitwise_equal(alone_in_halves / x.shape[-1], bi.mean(x)), "mean"
        for name, f in OPS.items():
            assert_bitwise_equal(f(x[:1]), f(x)[:1], name)
        native = not bitwise_equal(x[:1].sum(-1), x.sum(-1)[:1])
        print(f"native torch.sum at 2 threads: a lone long row {'differs' if native else 'keeps its bits'}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(dtype: torch.dtype) -> None:
    x = randn(9, 1000, seed=3, dtype=dtype, scale=4.0)
    w = torch.linspace(0.5, 1.5, 1000).to(dtype)
    xd, wd = x.double(), w.double()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(bi.sum(x).double(), xd.sum(-1), rtol=1e-5, atol=1e-3 if dtype == torch.float32 else 1.0)
    torch.testing.assert_close(bi.mean(x).double(), xd.mean(-1), **tol)
    torch.testing.assert_close(bi.softmax(x).double(), torch.softmax(xd, -1), **tol)
    torch.testing.assert_close(bi.log_softmax(x).double(), torch.log_softmax(xd, -1), **tol)
    torch.testing.assert_close(bi.rms_norm(x, w).double(), F.rms_norm(xd, (1000,), wd, 1e-6), **tol)
    assert bi.softmax(x).dtype == dtype


def test_float64_runs_float64_kernels() -> None:
    x = randn(9, 777, seed=5, scale=4.0).double()
    w = torch.linspace(0.5, 1.5, 777, dtype=torch.float64)
    tol = dict(rtol=1e-13, atol=1e-13)
    assert bi.softmax(x).dtype == torch.float64
    torch.testing.assert_close(bi.sum(x), x.sum(-1), **tol)
    torch.testing.assert_close(bi.softmax(x), torch.softmax(x, -1), **tol)
    torch.testing.assert_close(bi.log_softmax(x), torch.log_softmax(x, -1), **tol)
    torch.testing.assert_close(bi.rms_norm(x, w), F.rms_norm(x, (777,), w, 1e-6), **tol)


def test_special_values() -> None:
    nan_bits = torch.tensor(float("nan")).view(torch.int32).item()
    x = torch.tensor([[float("-inf"), 0.0, 1.0], [-0.0, -0.0, -0.0], [1.0, float("nan"), 2.0]])
    torch.testing.assert_close(bi.softmax(x)[0], torch.softmax(x, -1)[0])  # -inf gets exactly 0
    assert bi.softmax(x)[0, 0].item() == 0.0 and bi.log_softmax(x)[0, 0].item() == float("-inf")
    assert str(bi.sum(x[1:2]).item()) == "-0.0"  # lanes start at -0.0: an all -0.0 row stays -0.0
    assert bi.softmax(x[1:2]).eq(1 / 3).all()  # max of -0.0s is +0.0, exp(0) == 1
    for f in (bi.softmax, bi.log_softmax, bi.rms_norm):
        row = f(x[2:3])
        assert row.isnan().all() and row.view(torch.int32).eq(nan_bits).all(), f"{f.__name__}: canonical NaN"
    assert bi.rms_norm(torch.zeros(2, 5)).eq(0).all()


def test_compiled_code_keeps_the_kernels_and_their_bits() -> None:
    """fullgraph=True fails on a graph break: the custom ops (with fake kernels) trace."""
    x = randn(6, 50, seed=6, scale=3.0)
    w = torch.linspace(0.5, 1.5, 50)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return bi.softmax(x) + bi.log_softmax(x) + bi.rms_norm(x, w) + bi.sum(x, keepdim=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(compiled(x, w), f(x, w), "compiled forward")
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    compiled(*leaves).sum().backward()
    eager = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    f(*eager).sum().backward()
    for a, b in zip(leaves, eager):
        assert_bitwise_equal(a.grad, b.grad, "compiled backward")
    assert hasattr(torch.ops.titan_audit, "softmax") and hasattr(torch.ops.titan_audit, "rms_norm_backward")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"dim=3 is out of range .*\(2, 3\)"):
        bi.sum(torch.randn(2, 3), dim=3)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        bi.rms_norm(torch.randn(2, 3), torch.ones(4))
    with pytest.raises(ValueError, match=r"softmax_backward: grad \(2, 3\) and output \(2, 4\)"):
        R.softmax_backward(torch.ones(2, 3), torch.ones(2, 4))


def test_empty_rows() -> None:
    assert bi.softmax(torch.zeros(0, 5)).shape == (0, 5)
    assert bi.sum(torch.zeros(3, 0)).eq(0).all() and bi.sum(torch.zeros(3, 0)).shape == (3,)
    assert math.isclose(bi.mean(torch.ones(1, 7)).item(), 1.0)


def test_custom_ops_pass_opcheck() -> None:
    """Schema, fake (meta) implementation and AOT tracing of every titan_audit row op agree."""
    x, g, w = randn(5, 37, seed=7), randn(5, 37, seed=8), randn(37, seed=9)
    ops = torch.ops.titan_audit
    cases = [
        (ops.softmax, (x,)),
        (ops.log_softmax, (x,)),
        (ops.softmax_backward, (g, R.softmax(x))),
        (ops.log_softmax_backward, (g, R.log_softmax(x))),
        (ops.rms_norm, (x, w, 1e-6)),
        (ops.rms_norm, (x, None, 1e-6)),
        (ops.rms_norm_backward, (g, x, w, R.rms_norm(x, w, 1e-6)[1])),
        (ops.rms_norm_backward, (g, x, None, R.rms_norm(x, None, 1e-6)[1])),
        (ops.sum_dims, (x, [1], False)),
        (ops.sum_dims, (x.view(5, 37, 1), [0, 2], True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
