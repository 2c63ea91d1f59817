"""Triton backend, matmul and row ops, in Triton's interpreter on CPU tensors (marker `triton`).

Proves for the Triton kernels what tests/batch_invariant/test_matmul.py and test_reductions.py
prove for the CPU ones, bitwise: a row computed alone has the bits it has inside a batch (at
another position of another tile), for mm (float32, bfloat16, float16; a transposed weight;
fused bias), bmm, sum / mean over the last dim, softmax, log_softmax, rms_norm and the row
gradients (softmax, log_softmax, rms_norm grad_x); rms_norm's weight gradient is deterministic.
Hypothesis varies the shapes (M, K, N up to 70; rows up to 600 long) and the rows taken out.
Every result matches a float64 reference within the dtype's tolerance. Negative controls: a tile
configuration picked by M (another BK) and a row block picked by the batch give other bits, so the
bitwise checks can fail. The interpreter is reached without TRITON_INTERPRET (nothing leaks into
the environment) and the CPU backend is back after the block.
"""

from __future__ import annotations

import os

import pytest
import torch
from batch_invariant._helpers import randn
from batch_invariant._triton import TOL, close, triton_on_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal

pytestmark = pytest.mark.triton

MM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", MM_DTYPES)
def test_mm_row_alone_equals_row_in_batch(dtype: torch.dtype) -> None:
    x = randn(37, 40, seed=1, dtype=dtype)
    w = randn(24, 40, seed=2, dtype=dtype)  # a weight [N, K]: linear reads w.t() in place
    with triton_on_cpu():
        full = bi.linear(x, w)
        assert full.dtype == dtype
        for i in (0, 17, 36):  # tile rows 0, 1 and 4 of the 16-row tiles
            assert_bitwise_equal(bi.linear(x[i : i + 1], w), full[i : i + 1])
        assert_bitwise_equal(bi.matmul(x[3:21], w.t().contiguous()), full[3:21])  # B row-major: same bits
    close(full, x.double() @ w.double().t(), dtype)


def test_mm_bias_and_bmm() -> None:
    x = randn(21, 33, seed=3)
    w = randn(19, 33, seed=4)
    bias = randn(19, seed=5)
    a, b = randn(3, 18, 20, seed=6), randn(3, 20, 9, seed=7)
    with triton_on_cpu() as be:
        fused = be.mm(x, w.t(), bias)
        assert_bitwise_equal(be.mm(x[7:8], w.t(), bias), fused[7:8])
        out = bi.bmm(a, b)
        assert_bitwise_equal(bi.bmm(a[1:2, 5:9], b[1:2]), out[1:2, 5:9])
    close(fused, x.double() @ w.double().t() + bias.double(), torch.float32)
    close(out, a.double() @ b.double(), torch.float32)


@pytest.mark.control
def test_negative_control_tile_picked_by_m_changes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose K tile depended on M (as autotuned / heuristic gemms do) would break the row
    check: BK 16 vs 32 gives other bits for some row."""
    from titan_audit.batch_invariant.gpu import matmul

    x, w = randn(16, 96, seed=8), randn(16, 96, seed=9)
    with triton_on_cpu():
        one = bi.linear(x, w)
        monkeypatch.setitem(matmul.INTERPRETER_CONFIGS, torch.float32, (16, 16, 32, 1, 1))
        other = bi.linear(x, w)
    assert not bitwise_equal(one, other)
    close(other, x.double() @ w.double().t(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_row_alone_equals_row_in_batch(dtype: torch.dtype) -> None:
    x = randn(6, 300, seed=10, dtype=dtype)  # 300: two 256-wide chunks, the second masked
    w = randn(300, seed=11, dtype=dtype)
    x64 = x.double()
    with triton_on_cpu():
        outs = {
            "sum": bi.sum(x, -1),
            "mean": bi.mean(x, -1),
            "softmax": bi.softmax(x, -1),
            "log_softmax": bi.log_softmax(x, -1),
            "rms_norm": bi.rms_norm(x, w, 1e-6),
        }
        for i in (0, 4):
            row = x[i : i + 1]
            alone = {
                "sum": bi.sum(row, -1),
                "mean": bi.mean(row, -1),
                "softmax": bi.softmax(row, -1),
                "log_softmax": bi.log_softmax(row, -1),
                "rms_norm": bi.rms_norm(row, w, 1e-6),
            }
            for name, got in alone.items():
                assert_bitwise_equal(got, outs[name][i : i + 1])
    want = {
        "sum": x64.sum(-1),
        "mean": x64.mean(-1),
        "softmax": torch.softmax(x64, -1),
        "log_softmax": torch.log_softmax(x64, -1),
        "rms_norm": x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(),
    }
    for name, got in outs.items():
        tol_scale = 300 if name == "sum" else 1  # a sum of 300 terms: absolute error grows with N
        err = (got.double() - want[name]).abs().max().item()
        assert err <= TOL[dtype] * tol_scale * (1 + want[name].abs().max().item()), (name, err)


def test_row_gradients_invariant_and_deterministic() -> None:
    x = randn(5, 70, seed=12)
    w = randn(70, seed=13)
    g = randn(5, 70, seed=14)
    with triton_on_cpu():
        grads = {}
        for rows in (slice(0, 5), slice(2, 3)):
            xr = x[rows].clone().requires_grad_()
            wr = w.clone().requires_grad_()
            out = bi.rms_norm(xr, wr, 1e-6) + bi.softmax(xr, -1) + bi.log_softmax(xr, -1)
            out.backward(g[rows])
            grads[rows.start] = (xr.grad, wr.grad)
        assert_bitwise_equal(grads[2][0], grads[0][0][2:3])
        xr = x.clone().requires_grad_()
        wr = w.clone().requires_grad_()
        (bi.rms_norm(xr, wr, 1e-6) + bi.softmax(xr, -1) + bi.log_softmax(xr, -1)).backward(g)
        assert_bitwise_equal(wr.grad, grads[0][1])  # the weight gradient: deterministic
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    out = (
        x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
        + torch.softmax(x64, -1)
        + torch.log_softmax(x64, -1)
    )
    out.backward(g.double())
    close(grads[0][0], x64.grad, torch.float32)
    close(grads[0][1], w64.grad, torch.float32)


@pytest.mark.control
def test_negative_control_row_block_picked_by_batch_changes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row kernel whose lane count followed the batch would break the row check."""
    from titan_audit.batch_invariant.gpu import sum as gsum

    x = randn(4, 300, seed=15)
    with triton_on_cpu():
        one = bi.sum(x, -1)
        monkeypatch.setattr(gsum, "row_block", lambda n, t: (64, 1))
        other = bi.sum(x, -1)
    assert not bitwise_equal(one, other)


def test_interpreter_leaves_no_trace() -> None:
    """No TRITON_INTERPRET in the environment, triton.language unpatched (compiled kernels share
    the process), the CPU backend back after the block."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    names = ("__bool__", "__add__", "__floordiv__", "T")
    lang = {n: tl.tensor.__dict__.get(n) for n in names}
    funcs = (tl.zeros, tl.program_id, tl.load, JITFunction.__call__)
    before = os.environ.get("TRITON_INTERPRET")
    x = randn(3, 8, seed=16)
    with triton_on_cpu() as be:
        assert bi.backend_for(x) is be
        bi.softmax(x, -1)
        bi.linear(x, randn(4, 8, seed=17))
    assert os.environ.get("TRITON_INTERPRET") == before
    assert {n: tl.tensor.__dict__.get(n) for n in names} == lang
    assert (tl.zeros, tl.program_id, tl.load, JITFunction.__call__) == funcs
    assert bi.backend_for(x).NAME == "cpu"


def test_mode_routes_to_the_forced_backend() -> None:
    x, w = randn(5, 24, seed=17), randn(12, 24, seed=18)
    with triton_on_cpu() as be:
        direct = be.mm(x, w.t())
        with bi.enabled():
            via_mode = torch.nn.functional.linear(x, w)
    assert_bitwise_equal(via_mode, direct)


@pytest.mark.slow
@settings(max_examples=12)
@given(
    m=st.integers(1, 40),
    k=st.integers(1, 70),
    n=st.integers(1, 40),
    dtype=st.sampled_from(MM_DTYPES),
    row=st.data(),
)
def test_property_mm_rows_any_shape(m: int, k: int, n: int, dtype: torch.dtype, row: st.DataObject) -> None:
    x, w = randn(m, k, seed=m * 131 + k, dtype=dtype), randn(n, k, seed=n, dtype=dtype)
    i = row.draw(st.integers(0, m - 1))
    j = row.draw(st.integers(i, m - 1))
    with triton_on_cpu():
        full = bi.linear(x, w)
        assert_bitwise_equal(bi.linear(x[i : j + 1], w), full[i : j + 1])
    close(full, x.double() @ w.double().t(), dtype)


@pytest.mark.slow
@settings(max_examples=10)
@given(rows=st.integers(1, 9), n=st.integers(1, 600), row=st.data())
def test_property_row_ops_any_length(rows: int, n: int, row: st.DataObject) -> None:
    x = randn(rows, n, seed=n)
    i = row.draw(st.integers(0, rows - 1))
    with triton_on_cpu():
        for op in (lambda t: bi.sum(t, -1), lambda t: bi.softmax(t, -1), lambda t: bi.rms_norm(t, None, 1e-6)):
            assert_bitwise_equal(op(x[i : i + 1]), op(x)[i : i + 1])
    with triton_on_cpu():
        got = bi.log_softmax(x, -1)
    close(got, torch.log_softmax(x.double(), -1), torch.float32)
