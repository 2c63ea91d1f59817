"""The training-path kernels that replace a composition without changing a bit: column sums
(`sum_dims` over leading dims), the sum of squares behind `linalg.vector_norm`,
`scaled_rms_norm` (the weight applied after the norm, forward and backward) and `silu_mul`'s
backward (SwiGLU).

Proves, on every ISA variant this CPU runs and at 1 and 2 threads, float32 and float64:
- a sum over leading dims (a weight's gradient summed over batch and tokens), which now runs down
  the columns, and the sum over moved dims both equal an independent reference of the documented
  order (16 lanes: lane l adds rows l, l+16, ... from -0.0, then the fixed tree of ta::tree16),
  written here with one torch add per step;
- `sum_squares_dims` is that reference over x * x, and BI `vector_norm` its square root;
- `scaled_rms_norm` gives the bits of `weight * rms_norm(x)` (two ops, autograd) for the output,
  the input gradient and the weight gradient, and `models.ops.rms_norm` takes it only for float32
  BI runs (it normalises in float32 whatever x's dtype: bfloat16 and float64 keep their casts);
- `silu_mul` with autograd gives the bits of `silu(gate) * up` (the autograd silu of
  models/pointwise.py, then torch's multiply) for the output and both gradients, reading the two
  halves of one gate/up matrix in place, and `models.ops.silu_mul` takes it in BI training.
Negative controls: the column-sum kernel over the rows reversed, the rms_norm kernel's own weight
gradient (an fma chain down the rows) and silu composed with one more rounding (gate * sigmoid(gate))
give other bits on these inputs, so each comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.batch_invariant._helpers import num_threads, randn
from titan_audit import batch_invariant as bi
from titan_audit.audit.bitwise import assert_bitwise_equal, describe_difference
from titan_audit.batch_invariant.cpu import _lib, reductions
from titan_audit.models import ops, pointwise

LANES = 16


def _lane_tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """The documented order over dim 0 of `rows` [M, ...], one IEEE add per step: lane l adds
    rows l, l+16, ... ascending from -0.0, then s[i] = l[i] + l[i+8], s[i] += s[i+4], s[i] +=
    s[i+2], s[0] + s[1]."""
    lanes = [torch.full(rows.shape[1:], -0.0, dtype=rows.dtype) for _ in range(LANES)]
    for r in range(rows.shape[0]):
        lanes[r % LANES] = lanes[r % LANES] + rows[r]
    s = [lanes[i] + lanes[i + 8] for i in range(8)]
    s = [s[i] + s[i + 4] for i in range(4)]
    s = [s[i] + s[i + 2] for i in range(2)]
    return s[0] + s[1]


def _leading_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return _lane_tree_sum(x.reshape(-1, *x.shape[k:]))


CASES = [((1, 64, 256), 2), ((3, 5, 7), 1), ((2, 17, 33), 2), ((40, 3), 1), ((1, 64, 4, 64), 3), ((37, 70), 1)]


def _variants():  # noqa: ANN202
    for isa in _lib.available_isas():
        for threads in (1, 2):
            yield isa, threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sums_over_leading_dims_follow_the_lane_order_on_every_variant(dtype: torch.dtype) -> None:
    for shape, k in CASES:
        x = randn(*shape, seed=sum(shape), scale=100.0).to(dtype) * torch.logspace(-3, 3, shape[-1], dtype=dtype)
        want = _leading_reference(x, k)
        want_sq = _leading_reference(x * x, k)
        moved = x.movedim(-1, 0)  # the same sums with the reduced dims last: the row path
        for isa, threads in _variants():
            with _lib.forced_isa(isa), num_threads(threads):
                what = f"{isa}, {threads} threads, {list(shape)} over {k} leading dims, {dtype}"
                assert_bitwise_equal(reductions.sum_dims(x, list(range(k)), False), want, f"column sum, {what}")
                kept = reductions.sum_dims(x, list(range(k)), True)
                assert kept.shape == (1,) * k + shape[k:], what
                rows = reductions.sum_dims(moved, list(range(1, k + 1)), False).movedim(0, -1)
                assert_bitwise_equal(rows, want, f"row sum, {what}")
                got_sq = reductions.sum_squares_dims(x, list(range(k)), False)
                assert_bitwise_equal(got_sq, want_sq, f"sum of squares, {what}")


@pytest.mark.control
def test_negative_control_a_column_sum_in_another_order_differs() -> None:
    """The column sums' comparison can fail: the kernel over the rows reversed (each column added
    in the other order) gives other bits than the lane-ordered reference; torch's own column sum
    is reported, not asserted (its order depends on the CPU)."""
    x = randn(4096, 8, seed=1, scale=1.0) * torch.logspace(-4, 4, 8)
    want = _leading_reference(x, 1)
    assert_bitwise_equal(reductions.sum_dims(x, [0], False), want, "column sum")
    assert describe_difference(reductions.sum_dims(x.flip(0), [0], False), want) is not None
    print(f"torch's own column sum vs the lane order: {describe_difference(x.sum(0), want)}")


def test_vector_norm_in_bi_mode_is_the_root_of_the_lane_ordered_sum_of_squares() -> None:
    x = randn(3, 4099, seed=7, scale=0.01)
    with bi.enabled():
        whole = torch.linalg.vector_norm(x, 2.0)
        per_column = torch.linalg.vector_norm(x, 2.0, dim=0)
        want = _lane_tree_sum((x * x).reshape(-1, 1)).squeeze(0).sqrt()
        want_columns = _lane_tree_sum(x * x).sqrt()
    assert_bitwise_equal(whole, want, "vector_norm of all elements")
    assert_bitwise_equal(per_column, want_columns, "vector_norm over dim 0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 64, 256), (3, 17, 33), (2, 40, 2, 64), (5, 1)])
def test_scaled_rms_norm_is_bitwise_weight_times_norm_forward_and_backward(shape, dtype) -> None:  # noqa: ANN001
    seed = sum(shape)
    x = randn(*shape, seed=seed, scale=3.0).to(dtype).requires_grad_()
    weight = (randn(shape[-1], seed=seed + 1) + 1.0).to(dtype).requires_grad_()
    grad_out = randn(*shape, seed=seed + 2).to(dtype)
    with bi.enabled():
        y_ref = weight * bi.rms_norm(x, None, 1e-6)
        refs = (y_ref, *torch.autograd.grad(y_ref, (x, weight), grad_out))
        for isa, threads in _variants():
            with _lib.forced_isa(isa), num_threads(threads):
                y = bi.scaled_rms_norm(x, weight, 1e-6)
                assert y.grad_fn is not None and "ScaledRMSNorm" in type(y.grad_fn).__name__
                got = (y, *torch.autograd.grad(y, (x, weight), grad_out))
                with torch.no_grad():
                    inference = bi.scaled_rms_norm(x, weight, 1e-6)
            for name, a, b in zip(("output", "grad x", "grad weight"), got, refs):
                assert_bitwise_equal(a, b, f"scaled_rms_norm {name}, {isa}, {threads} threads, {list(shape)}")
            assert_bitwise_equal(inference, y_ref, f"scaled_rms_norm without autograd, {isa}")


@pytest.mark.control
def test_scaled_rms_norm_weight_gradient_control_and_input_errors() -> None:
    x = randn(512, 64, seed=3, scale=3.0).requires_grad_()
    weight = (randn(64, seed=4) + 1.0).requires_grad_()
    grad_out = randn(512, 64, seed=5)
    with bi.enabled():
        _, grad_w = torch.autograd.grad(bi.scaled_rms_norm(x, weight, 1e-6), (x, weight), grad_out)
        # the rms_norm kernel's own weight gradient: an fma chain down the rows, another order
        _, fma_chain_w = torch.autograd.grad(bi.rms_norm(x, weight, 1e-6), (x, weight), grad_out)
    assert describe_difference(grad_w, fma_chain_w) is not None
    with pytest.raises(ValueError, match="weight"):
        bi.scaled_rms_norm(x, weight[:3])
    with pytest.raises(ValueError, match="float32 or float64"):
        bi.scaled_rms_norm(x.bfloat16(), weight.bfloat16())


def test_models_rms_norm_takes_the_fused_op_for_float32_bi_only() -> None:
    x = randn(2, 8, 32, seed=9).requires_grad_()
    weight = (randn(32, seed=10) + 1.0).requires_grad_()
    with bi.enabled():
        fused = ops.rms_norm(x, weight, 1e-6)
        half = ops.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)  # the cast sits between norm and weight
        double = ops.rms_norm(x.double(), weight.double(), 1e-6)  # the norm in float32, then cast back
    assert "ScaledRMSNorm" in type(fused.grad_fn).__name__
    assert "Mul" in type(half.grad_fn).__name__ and "Mul" in type(double.grad_fn).__name__
    assert "ScaledRMSNorm" not in type(ops.rms_norm(x, weight, 1e-6).grad_fn).__name__  # native ops outside BI


@pytest.mark.parametrize(("m", "n"), [(1, 1), (3, 7), (64, 768), (5, 1023)])
def test_silu_mul_backward_is_bitwise_the_two_ops_on_every_variant(m: int, n: int) -> None:
    gate_up = randn(m, 2 * n, seed=m + n, scale=6.0).requires_grad_()
    grad_out = randn(m, n, seed=m + n + 1)
    with bi.enabled():
        y_ref = pointwise.silu(gate_up[:, :n]) * gate_up[:, n:]
        refs = (y_ref, *torch.autograd.grad(y_ref, gate_up, grad_out))
        for isa, threads in _variants():
            with _lib.forced_isa(isa), num_threads(threads):
                y = bi.silu_mul(gate_up[:, :n], gate_up[:, n:])  # the halves, read in place
                assert "SiluMul" in type(y.grad_fn).__name__
                got = (y, *torch.autograd.grad(y, gate_up, grad_out))
            for name, a, b in zip(("output", "grad of gate | up"), got, refs):
                assert_bitwise_equal(a, b, f"silu_mul {name}, {isa}, {threads} threads, [{m}, {n}]")


@pytest.mark.control
def test_negative_control_silu_with_one_more_rounding_gives_other_bits() -> None:
    """The silu_mul comparison can fail: silu composed as gate * sigmoid(gate) (one rounding more
    than the silu kernel) gives other output and gradient bits than the autograd reference."""
    m, n = 64, 768
    gate_up = randn(m, 2 * n, seed=m + n, scale=6.0).requires_grad_()
    grad_out = randn(m, n, seed=m + n + 1)
    with bi.enabled():
        gate, up = gate_up[:, :n], gate_up[:, n:]
        y_ref = pointwise.silu(gate) * up
        grad_ref = torch.autograd.grad(y_ref, gate_up, grad_out)[0]
        y_other = gate * pointwise.sigmoid(gate) * up
        grad_other = torch.autograd.grad(y_other, gate_up, grad_out)[0]
    assert describe_difference(y_other, y_ref) is not None
    assert describe_difference(grad_other, grad_ref) is not None


def test_models_silu_mul_takes_the_fused_op_in_bi_training() -> None:
    gate, up = randn(4, 96, seed=11).requires_grad_(), randn(4, 96, seed=12).requires_grad_()
    with bi.enabled():
        assert "SiluMul" in type(ops.silu_mul(gate, up).grad_fn).__name__
        assert "Mul" in type(ops.silu_mul(gate.bfloat16(), up.bfloat16()).grad_fn).__name__
    assert "SiluMul" not in type(ops.silu_mul(gate, up).grad_fn).__name__  # native ops outside BI
