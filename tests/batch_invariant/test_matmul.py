"""The matmul family (mm, matmul, linear, addmm, bmm) is row-invariant, bitwise.

Proves: row i of a batched product equals the product of row i alone (and of any slice holding
it) for random shapes, batch sizes 1..512, row positions, float32 and bfloat16, and thread
counts 1 and 2; the bits do not change between 1 and 2 threads for the bench's LLM shapes;
results are within float32 tolerance of a float64 reference. Negative controls: plain torch
(MKL) gives different bits for the same rows on this machine, and so does oneDNN's inner product
for a single row, so the checks can fail.
"""

from __future__ import annotations

import pytest
import torch
from batch_invariant._helpers import DTYPES, num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal

LLM_SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024)]


def _slice(data: st.DataObject, batch: int) -> tuple[int, int]:
    start = data.draw(st.integers(0, batch - 1), label="start")
    length = data.draw(st.integers(1, batch - start), label="length")
    return start, length


@settings(max_examples=200)
@given(data=st.data())
def test_linear_rows_do_not_depend_on_the_batch(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 512), label="batch")
    k = data.draw(st.integers(1, 300), label="K")
    n = data.draw(st.integers(1, 300), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    with_bias = data.draw(st.booleans(), label="bias")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x = randn(batch, k, seed=seed, dtype=dtype)
    w = randn(n, k, seed=seed + 1, dtype=dtype)
    b = randn(n, seed=seed + 2, dtype=dtype) if with_bias else None
    start, length = _slice(data, batch)
    with num_threads(threads):
        full = bi.linear(x, w, b)
        assert_bitwise_equal(bi.linear(x[start : start + length], w, b), full[start : start + length], "slice")
        assert_bitwise_equal(bi.linear(x[start : start + 1], w, b), full[start : start + 1], "single row")


@settings(max_examples=200)
@given(data=st.data())
def test_mm_matmul_addmm_rows_do_not_depend_on_the_batch(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 512), label="batch")
    k = data.draw(st.integers(1, 300), label="K")
    n = data.draw(st.integers(1, 300), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    transposed_b = data.draw(st.booleans(), label="b transposed")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    a = randn(batch, k, seed=seed, dtype=dtype)
    b = randn(n, k, seed=seed + 1, dtype=dtype).t() if transposed_b else randn(k, n, seed=seed + 1, dtype=dtype)
    bias = randn(n, seed=seed + 2, dtype=dtype)
    start, length = _slice(data, batch)
    rows = slice(start, start + length)
    assert_bitwise_equal(bi.mm(a[rows], b), bi.mm(a, b)[rows], "mm")
    assert_bitwise_equal(bi.addmm(bias, a[rows], b, beta=0.5, alpha=2.0), bi.addmm(bias, a, b, beta=0.5, alpha=2.0)[rows], "addmm")
    a3 = a.reshape(1, batch, k)
    assert_bitwise_equal(bi.matmul(a3[:, rows], b), bi.matmul(a3, b)[:, rows], "matmul 3-D @ 2-D")
    assert_bitwise_equal(bi.matmul(a[start], b), bi.mm(a, b)[start], "matmul 1-D @ 2-D")
    other_layout = b.t().contiguous().t()  # the same matrix stored the other way round
    assert_bitwise_equal(bi.mm(a[rows], other_layout), bi.mm(a, b)[rows], "weight layout")


@settings(max_examples=200)
@given(data=st.data())
def test_bmm_rows_do_not_depend_on_batch_or_rows(data: st.DataObject) -> None:
    nb = data.draw(st.integers(1, 8), label="B")
    m = data.draw(st.integers(1, 64), label="M")
    k = data.draw(st.integers(1, 48), label="K")
    n = data.draw(st.integers(1, 48), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    a = randn(nb, m, k, seed=seed, dtype=dtype)
    b = randn(nb, k, n, seed=seed + 1, dtype=dtype)
    j = data.draw(st.integers(0, nb - 1), label="j")
    start, length = _slice(data, m)
    full = bi.bmm(a, b)
    assert_bitwise_equal(bi.bmm(a[j : j + 1, start : start + length], b[j : j + 1]), full[j : j + 1, start : start + length])
    assert_bitwise_equal(bi.matmul(a[j : j + 1, start : start + length], b[j : j + 1]), full[j : j + 1, start : start + length], "3-D matmul")


@pytest.mark.parametrize(("k", "n"), LLM_SHAPES)
def test_llm_shapes_rows_and_threads(k: int, n: int) -> None:
    """The bench shapes: every M in 1..12 and a few larger, 1 and 2 threads, all the same bits."""
    x = randn(260, k, seed=1)
    w = randn(n, k, seed=2)
    with num_threads(1):
        ref = bi.linear(x, w)
    with num_threads(2):
        assert_bitwise_equal(bi.linear(x, w), ref, "1 vs 2 threads")
        for m in [*range(1, 13), 31, 64, 255]:
            assert_bitwise_equal(bi.linear(x[3 : 3 + m], w), ref[3 : 3 + m], f"M={m}")


def test_negative_control_native_mkl_rows_differ() -> None:
    """Plain torch gives a row different bits alone than in a batch: for M < 4 at 1 thread and
    for M in 5..11 at 2 threads (the rows past the last multiple of 4); bi.linear does not."""
    x = randn(64, 1024, seed=3)
    w = randn(1024, 1024, seed=4)
    with num_threads(2):
        full = x @ w.t()
        differs = [m for m in range(1, 13) if not bitwise_equal(x[:m] @ w.t(), full[:m])]
        assert set(differs) >= {1, 2, 3, 5, 6, 7, 9, 10, 11}, differs
        for m in differs:
            assert_bitwise_equal(bi.linear(x[:m], w), bi.linear(x, w)[:m], f"M={m}")
    with num_threads(1):
        full = x @ w.t()
        assert not bitwise_equal(x[:1] @ w.t(), full[:1])


def test_negative_control_onednn_single_row() -> None:
    """oneDNN's inner product (the float32 mm kernel) gives one row alone other bits than the
    same row among two or more: the reason bi.mm pads M == 1 to two rows."""
    x = randn(64, 1024, seed=12)
    w = randn(512, 1024, seed=13)
    def onednn(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")
    full = onednn(x)
    assert not bitwise_equal(onednn(x[5:6].clone()), full[5:6])
    assert_bitwise_equal(onednn(x[5:7].clone()), full[5:7], "two rows share the M >= 2 family")
    assert_bitwise_equal(bi.linear(x[5:6], w), bi.linear(x, w)[5:6], "bi pads the single row")


def test_negative_control_small_n() -> None:
    """With N <= 11 columns MKL's row bits depend on M even at multiples of 4; bi.linear's do not."""
    x = randn(300, 31, seed=5)
    w = randn(7, 31, seed=6)
    full = x @ w.t()
    native_differs = any(not bitwise_equal(x[i : i + m] @ w.t(), full[i : i + m]) for i, m in ((5, 7), (13, 40), (2, 100), (1, 299), (0, 1)))
    assert native_differs
    ours = bi.linear(x, w)
    for i, m in ((5, 7), (13, 40), (2, 100), (1, 299), (0, 1)):
        assert_bitwise_equal(bi.linear(x[i : i + m], w), ours[i : i + m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(dtype: torch.dtype) -> None:
    x = randn(33, 300, seed=7, dtype=dtype)
    w = randn(70, 300, seed=8, dtype=dtype)
    b = randn(70, seed=9, dtype=dtype)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(bi.linear(x, w, b).double(), ref, **tol)
    a3 = randn(3, 17, 40, seed=10, dtype=dtype)
    b3 = randn(3, 40, 9, seed=11, dtype=dtype)
    torch.testing.assert_close(bi.bmm(a3, b3).double(), a3.double() @ b3.double(), **tol)
    assert bi.linear(x, w, b).dtype == dtype


def test_bad_input_names_argument_and_shape() -> None:
    with pytest.raises(ValueError, match=r"mm: expected a \[M, K\].*\(3, 4\).*\(5, 2\)"):
        bi.mm(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(ValueError, match="weight"):
        bi.linear(torch.randn(3, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="dtypes must match"):
        bi.mm(torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating"):
        bi.matmul(torch.ones(3, 4, dtype=torch.long), torch.ones(4, 2, dtype=torch.long))


@settings(max_examples=200)
@given(data=st.data())
def test_layout_facts_the_attention_kernel_relies_on(data: st.DataObject) -> None:
    """Two measured MKL facts: (1) the row stride of A (lda) does not change bits, so strided row
    views skip a copy; (2) a chunk of output columns (64-aligned) has the same bits whatever
    other columns are computed with it, so attention scores for a group of key chunks come from
    one gemm. Controls: none possible for a property that holds; (2)'s contrast is that the
    reduction dim is never split this way (p @ v stays one gemm per chunk)."""
    nb = data.draw(st.integers(1, 8), label="B")
    m = data.draw(st.sampled_from([1, 3, 4, 8, 12, 64, 128]), label="M")
    k = data.draw(st.sampled_from([4, 8, 16, 64, 100, 128]), label="K")
    chunks = data.draw(st.integers(1, 12), label="chunks")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    wide = randn(nb, m, 3 * k, seed=seed)
    a = wide[:, :, k : 2 * k]
    keys = randn(nb, chunks * 64, k, seed=seed + 1)
    full = bi.bmm(a, keys.transpose(1, 2))
    assert_bitwise_equal(full, bi.bmm(a.contiguous(), keys.transpose(1, 2)), "strided rows")
    c0 = data.draw(st.integers(0, chunks - 1), label="c0")
    n = data.draw(st.integers(1, chunks - c0), label="n")
    part = bi.bmm(a, keys[:, c0 * 64 : (c0 + n) * 64].transpose(1, 2))
    assert_bitwise_equal(part, full[:, :, c0 * 64 : (c0 + n) * 64], "column chunks")


def test_torch_without_onednn_is_refused_not_silently_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(NotImplementedError, match="no oneDNN"):
        bi.linear(randn(3, 8, seed=14), randn(5, 8, seed=15))
