"""The matmul family (mm, matmul, linear, addmm, bmm) on our own gemm kernel is row-invariant,
bitwise, and gives the same bits on every ISA variant and thread count.

Proves: row i of a batched product equals the product of row i alone (and of any slice holding
it) for random shapes, batch sizes 1..512, row positions, both B layouts ([K, N] and W.t()),
float32 and bfloat16, threads 1 and 2; every ISA variant the CPU has (scalar, avx2, avx512) gives
identical bits for random shapes (the in-CI stand-in for other CPUs); each output is literally one
ascending fma chain over k from +0.0 under gemm order v1, and the halving tree of such chains over
K-blocks under v2 (the default; checked against exact rational arithmetic); the packed-weight
cache never serves a stale packing; torch.compile keeps the bits; nothing of MKL/oneDNN runs;
results are within float32 tolerance of a float64 reference. Negative controls: the rows
computed alone with K split in two (two bi.linear products added) differ from the same rows in the
batch, and a split-K gemm differs from ours, so both the invariance checks and the cross-variant
check can fail.
"""

from __future__ import annotations

import gc
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from batch_invariant._helpers import DTYPES, num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu import matmul as cpu_matmul

LLM_SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024)]


def _slice(data: st.DataObject, batch: int) -> tuple[int, int]:
    start = data.draw(st.integers(0, batch - 1), label="start")
    length = data.draw(st.integers(1, batch - start), label="length")
    return start, length


def _b_operand(data: st.DataObject, k: int, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """B [K, N] stored row-major, or as W.t() for a row-major weight W [N, K] (linear's layout)."""
    if data.draw(st.booleans(), label="B = W.t()"):
        return randn(n, k, seed=seed, dtype=dtype).t()
    return randn(k, n, seed=seed, dtype=dtype)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
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
    with num_threads(3 - threads):
        assert_bitwise_equal(bi.linear(x, w, b), full, "other thread count")


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mm_matmul_addmm_rows_do_not_depend_on_the_batch(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 512), label="batch")
    k = data.draw(st.integers(1, 300), label="K")
    n = data.draw(st.integers(1, 300), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    a = randn(batch, k, seed=seed, dtype=dtype)
    b = _b_operand(data, k, n, seed + 1, dtype)
    bias = randn(n, seed=seed + 2, dtype=dtype)
    start, length = _slice(data, batch)
    rows = slice(start, start + length)
    with num_threads(threads):
        full = bi.mm(a, b)
        assert_bitwise_equal(bi.mm(a[rows], b), full[rows], "mm")
        assert_bitwise_equal(
            bi.addmm(bias, a[rows], b, beta=0.5, alpha=2.0), bi.addmm(bias, a, b, beta=0.5, alpha=2.0)[rows], "addmm"
        )
        a3 = a.reshape(1, batch, k)
        assert_bitwise_equal(bi.matmul(a3[:, rows], b), bi.matmul(a3, b)[:, rows], "matmul 3-D @ 2-D")
        assert_bitwise_equal(bi.matmul(a[start], b), full[start], "matmul 1-D @ 2-D")
        other_layout = b.t().contiguous().t() if b.stride(1) == 1 else b.contiguous()  # same matrix, other storage
        assert_bitwise_equal(bi.mm(a[rows], other_layout), full[rows], "B layout")
        assert_bitwise_equal(bi.mm(a.t().contiguous().t()[rows], b), full[rows], "A stored transposed")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_bmm_rows_do_not_depend_on_batch_or_rows(data: st.DataObject) -> None:
    nb = data.draw(st.integers(1, 8), label="B")
    m = data.draw(st.integers(1, 64), label="M")
    k = data.draw(st.integers(1, 80), label="K")
    n = data.draw(st.integers(1, 80), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    a = randn(nb, m, k, seed=seed, dtype=dtype)
    b = (
        randn(nb, n, k, seed=seed + 1, dtype=dtype).transpose(1, 2)
        if data.draw(st.booleans(), label="B^T")
        else randn(nb, k, n, seed=seed + 1, dtype=dtype)
    )
    j = data.draw(st.integers(0, nb - 1), label="j")
    start, length = _slice(data, m)
    with num_threads(threads):
        full = bi.bmm(a, b)
        part = full[j : j + 1, start : start + length]
        assert_bitwise_equal(bi.bmm(a[j : j + 1, start : start + length], b[j : j + 1]), part)
        assert_bitwise_equal(bi.matmul(a[j : j + 1, start : start + length], b[j : j + 1]), part, "3-D matmul")
        assert_bitwise_equal(bi.mm(a[j, start : start + length], b[j]), part[0], "bmm entry == mm")


# ---------------------------------------------------------------- the same bits on every variant


def _variant_products(a: torch.Tensor, b: torch.Tensor, batched: bool) -> dict[str, torch.Tensor]:
    out = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            out[isa] = bi.bmm(a, b) if batched else bi.mm(a, b)
    return out


def assert_same_bits_as_scalar(outs: dict[str, torch.Tensor]) -> None:
    """The cross-variant check: every variant's bits equal the portable scalar variant's."""
    for isa, out in outs.items():
        assert_bitwise_equal(out, outs["scalar"], f"{isa} vs scalar")


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_isa_variant_gives_identical_bits(data: st.DataObject) -> None:
    """Random shapes (M 1..200: single tiles, edge tiles, several row blocks; N across panel
    edges; K across k-block edges), both B layouts, fp32 / bf16 / fp64, threads 1 and 2."""
    m = data.draw(st.one_of(st.integers(1, 4), st.integers(1, 200)), label="M")  # few rows: their own path
    k = data.draw(st.sampled_from([1, 2, 7, 31, 64, 100, 255, 256, 257, 513, 700]), label="K")
    n = data.draw(st.integers(1, 100), label="N")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    a = randn(m, k, seed=seed, dtype=dtype)
    b = _b_operand(data, k, n, seed + 1, dtype)
    with num_threads(threads):
        assert_same_bits_as_scalar(_variant_products(a, b, batched=False))
        a3, b3 = a.reshape(1, m, k).expand(2, m, k), torch.stack([b, b.flip(0)])
        assert_same_bits_as_scalar(_variant_products(a3, b3, batched=True))


@pytest.mark.parametrize(("k", "n"), [(1, 1), (37, 70), (64, 32), (33, 100)])
def test_packing_layout_is_the_same_on_every_variant(k: int, n: int) -> None:
    """pack(B): panel p holds B[k, 32p + c] at (p * K + k) * 32 + c, zero past N, from either B
    layout and on every variant (the avx512 transposing pack included)."""
    b = randn(k, n, seed=38)
    padded = torch.zeros(k, -(-n // 32) * 32)
    padded[:, :n] = b
    expected = padded.reshape(k, -1, 32).permute(1, 0, 2).reshape(-1)
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            assert_bitwise_equal(cpu_matmul.pack(b), expected, f"{isa} row-major")
            assert_bitwise_equal(cpu_matmul.pack(b.t().contiguous().t()), expected, f"{isa} W.t()")


def _round_f32(q: Fraction) -> float:
    """The float32 nearest to q (ties to even), by exact arithmetic (finite, no overflow)."""
    if q == 0:
        return 0.0
    sign, q = (-1, -q) if q < 0 else (1, q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    units = q / ulp
    whole = math.floor(units)
    rest = units - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    return sign * float(whole * ulp)


def _fma_chain(a_row: list[float], b_col: list[float]) -> float:
    """acc = +0.0; for k ascending: acc = fma(a[k], b[k], acc) in float32 (each step rounded once).
    Starting from +0.0 no step can make acc -0.0, so a zero result is +0.0."""
    acc = Fraction(0)
    for x, y in zip(a_row, b_col, strict=True):
        acc = Fraction(_round_f32(Fraction(x) * Fraction(y) + acc))
    return float(acc)


def _tree_of_chains(a_row: list[float], b_col: list[float], p: int) -> float:
    """Gemm order v2: `_fma_chain` over each of p equal K-blocks, the block sums combined by the
    halving tree (node = left + right, each add rounded once to float32)."""
    bs = len(a_row) // p
    sums = [Fraction(_fma_chain(a_row[j * bs : (j + 1) * bs], b_col[j * bs : (j + 1) * bs])) for j in range(p)]
    while len(sums) > 1:
        sums = [Fraction(_round_f32(sums[i] + sums[i + 1])) for i in range(0, len(sums), 2)]
    return float(sums[0])


@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_each_output_is_one_ascending_fma_chain(isa: str, order: str) -> None:
    """The order by construction, literally: under gemm order v1 every output equals the
    exact-arithmetic float32 fma chain over k ascending from +0.0; under v2 (K = 600: 8 blocks of
    75) the halving tree of those chains over each block. The chains over descending k or with
    separate multiply and add (the control) give other bits for some outputs, so the comparison
    can fail; v1's chain and v2's tree differ too."""
    if isa not in _lib.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant")
    # 13 rows: two row tiles on every variant, so K = 600 is cut into k-blocks (256 or 512) whose
    # fp32 partials are stored and reloaded; columns on both sides of the 32-column panel edge.
    m, k, n = 13, 600, 40
    cols_checked = [0, 5, 31, 32, 39]
    a = randn(m, k, seed=21, scale=3.0)
    b = randn(k, n, seed=22)
    with _lib.forced_isa(isa), bi.gemm_order(order):
        out = bi.mm(a, b)[:, cols_checked]
        one_row = bi.mm(a[:1], b)[:, cols_checked]  # one row: B streamed in place (row-major)
        two_rows = bi.mm(a[:2], b.t().contiguous().t())[:, cols_checked]  # one tile over all of K (W.t())
    rows, cols = a.tolist(), b.t()[cols_checked].tolist()
    chains = torch.tensor([[_fma_chain(rows[i], col) for col in cols] for i in range(m)], dtype=torch.float32)
    if order == "v1":
        expected = chains
    else:
        expected = torch.tensor([[_tree_of_chains(rows[i], col, 8) for col in cols] for i in range(m)])
        assert not bitwise_equal(expected, chains), "control: v2's tree must be visible in the bits"
    assert_bitwise_equal(out, expected, f"gemm order {order}")
    assert_bitwise_equal(one_row, expected[:1], "one row, row-major B")
    assert_bitwise_equal(two_rows, expected[:2], "two rows, B = W.t()")
    descending = torch.tensor([_fma_chain(rows[0][::-1], col[::-1]) for col in cols], dtype=torch.float32)
    assert not bitwise_equal(descending, chains[0]), "control: the k order must be visible in the bits"
    a32, b32 = rows[0], cols
    unfused = []
    for j in range(len(cols)):
        acc = torch.zeros((), dtype=torch.float32)
        for x, y in zip(a32, b32[j], strict=True):
            acc = acc + torch.tensor(x, dtype=torch.float32) * torch.tensor(y, dtype=torch.float32)
        unfused.append(acc)
    assert not bitwise_equal(torch.stack(unfused), chains[0]), "control: fma must be visible in the bits"


@pytest.mark.control
@pytest.mark.parametrize(("order", "cut"), [("v1", 300), ("v2", 200)])
def test_negative_control_split_k_differs_and_is_caught(order: str, cut: int) -> None:
    """A gemm that splits k (two K-slice products added: what a split-K or k-parallel kernel does)
    gives other bits; the cross-variant check flags it. Under v1 any split; under v2 a split off
    its tree (K = 600 in 8 blocks of 75: at 200; the half at 300 is a subtree and reproduces v2,
    which test_gemm_tree.py proves)."""
    a = randn(37, 600, seed=23)
    b = randn(600, 70, seed=24)
    with bi.gemm_order(order):
        ours = bi.mm(a, b)
        split = bi.mm(a[:, :cut], b[:cut]) + bi.mm(a[:, cut:], b[cut:])
    assert not bitwise_equal(split, ours)
    torch.testing.assert_close(split, ours, rtol=1e-4, atol=1e-4)  # the same product, other rounding
    with pytest.raises(AssertionError):
        assert_same_bits_as_scalar({"scalar": ours, "split-k": split})


# ---------------------------------------------------------------- threads, LLM shapes, controls


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
        assert_bitwise_equal(bi.matmul(x[3:40], w.t().contiguous()), ref[3:40], "B row-major")


@pytest.mark.control
def test_negative_control_rows_alone_with_another_k_split_differ() -> None:
    """The row check can fail: each row computed alone by a kernel that splits K (two bi.linear
    products over K = 0..99 and 100..299, added; off v2's tree of 4 blocks of 75) gives other bits
    than the row in the batch, at every M in 1..16 and at 1 and 2 threads, under the same
    comparison bi.linear passes. Native torch's rows are reported, not asserted: whether MKL keeps
    a row's bits alone depends on the CPU."""
    x = randn(64, 300, seed=3)
    w = randn(256, 300, seed=4)
    for threads in (1, 2):
        with num_threads(threads):
            ours = bi.linear(x, w)
            for m in range(1, 17):
                split = bi.linear(x[:m, :100], w[:, :100]) + bi.linear(x[:m, 100:], w[:, 100:])
                assert not bitwise_equal(split, ours[:m]), f"M={m}: the split gave the batch's bits"
                with pytest.raises(AssertionError):
                    assert_bitwise_equal(split, ours[:m], f"M={m}")
                assert_bitwise_equal(bi.linear(x[:m], w), ours[:m], f"M={m}")
            full = x @ w.t()
            native = [m for m in range(1, 17) if not bitwise_equal(x[:m] @ w.t(), full[:m])]
            print(f"native torch at {threads} threads: rows alone differ from the batch at M in {native}")


def test_no_library_gemm_runs() -> None:
    """bi.mm / bi.linear / bi.bmm and the override mode's linear run no aten or oneDNN gemm: the
    profiler sees no mm/bmm/addmm below our entry points (so no MKL/oneDNN, no re-entry)."""
    gemms = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "mkldnn::_linear_pointwise"}
    x, w = randn(8, 64, seed=25), randn(32, 64, seed=26)
    with torch.profiler.profile() as prof:
        bi.mm(x, w.t()), bi.linear(x, w), bi.bmm(x[None], w.t()[None])
    assert not {e.name for e in prof.events()} & gemms
    with bi.enabled(), torch.profiler.profile() as prof:
        F.linear(x, w)
    names = [e.name for e in prof.events() if e.name in gemms]
    assert names.count("aten::mm") + names.count("aten::addmm") == 1 and "mkldnn::_linear_pointwise" not in names, names


# ---------------------------------------------------------------- the packed-weight cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_cache_serves_fresh_packings_only(dtype: torch.dtype) -> None:
    """A weight seen twice is served packed; an in-place update (an optimizer step) is seen; a
    freed weight's entry goes; the bound evicts. Every result equals an uncached product."""
    cache = cpu_matmul.PACKED_CACHE
    cache.clear()
    x = randn(3, 256, seed=27, dtype=dtype)
    w = randn(128, 256, seed=28, dtype=dtype)
    first = bi.linear(x, w)
    assert len(cache) == 0  # first sight: packed by the kernel, not kept
    assert_bitwise_equal(bi.linear(x, w), first)
    assert len(cache) == 1  # second sight: kept
    assert_bitwise_equal(bi.linear(x, w), first, "served from the cache")
    with torch.no_grad():
        w.mul_(-0.5)  # in place: the version counter moves
    assert_bitwise_equal(bi.linear(x, w), bi.linear(x, w.clone()), "after an in-place update")
    assert not bitwise_equal(bi.linear(x, w), first)
    del w
    gc.collect()
    assert len(cache) == 0  # the owner died: its packing is freed with it
    small = cpu_matmul.PackedCache(max_bytes=3 * 128 * 256 * 4)
    weights = [randn(128, 256, seed=s) for s in range(5)]
    for wt in weights:
        for _ in range(2):
            small.get(wt.t(), torch.float32)
    assert len(small) == 3 and small.nbytes <= small.max_bytes  # least recently used evicted


def test_packed_cache_packs_a_parameter_at_first_sight_and_repacks_it_in_place() -> None:
    """A parameter (an nn.Parameter owns B's memory) is packed on its first product; after an
    in-place update (an optimizer step) the next product repacks it into the same buffer. Every
    result equals the uncached product of the weight as it is then."""
    cache = cpu_matmul.PACKED_CACHE
    cache.clear()
    x = randn(4, 256, seed=34)
    w = torch.nn.Parameter(randn(96, 256, seed=35))
    with torch.no_grad():
        first = bi.linear(x, w)
        assert len(cache) == 1  # first sight of a parameter: kept
        packed = cache.get(w.t(), torch.float32)
        assert packed is not None
        address = packed.data_ptr()
        del packed
        w.mul_(-0.5)  # in place: the version counter moves
        updated = bi.linear(x, w)
        assert_bitwise_equal(updated, bi.linear(x, w.detach().clone()), "after the update")
        assert not bitwise_equal(updated, first)
        assert cache.get(w.t(), torch.float32).data_ptr() == address  # repacked where it was
    cache.clear()


def test_packed_cache_key_is_identity_not_address() -> None:
    """Two tensors at the same address with the same version (a view and a new tensor over the
    same storage) never share an entry unless they are the same owner; clearing drops all."""
    cache = cpu_matmul.PackedCache()
    w = randn(64, 128, seed=29)
    alias = torch.empty(0).set_(w.untyped_storage(), 0, w.shape, w.stride())  # same address, other owner
    assert cache.get(w.t(), torch.float32) is None and cache.get(alias.t(), torch.float32) is None  # first sights
    assert cache.get(w.t(), torch.float32) is not None
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


# ---------------------------------------------------------------- torch.compile, accuracy, errors


def test_torch_compile_keeps_the_bits() -> None:
    """A compiled function calling bi.linear / bi.bmm (the titan_audit::mm / ::bmm custom ops in the
    graph) and one compiled under the override mode (aot_eager: the mode's kernels) give eager's bits."""
    torch._dynamo.reset()
    x, w = randn(5, 96, seed=30), randn(40, 96, seed=31)
    a, b = randn(3, 7, 24, seed=32), randn(3, 24, 9, seed=33)

    def fn(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bi.linear(x, w).relu(), bi.bmm(a, b)

    eager = fn(x, w, a, b)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, a, b)
    for e, c in zip(eager, compiled, strict=True):
        assert_bitwise_equal(c, e, "bi ops compiled")

    def native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w) @ w

    with bi.enabled():
        eager_mode = native(x, w)
        compiled_mode = torch.compile(native, backend="aot_eager")(x, w)
    assert_bitwise_equal(compiled_mode, eager_mode, "override mode compiled")
    assert_bitwise_equal(eager_mode, bi.mm(bi.linear(x, w), w), "override mode == bi ops")
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_keeps_the_custom_ops_opaque() -> None:
    """Under inductor too (it fuses the pointwise ops around them), titan_audit::mm / ::bmm run
    our kernel: the products' bits are eager's."""
    torch._dynamo.reset()
    x, w = randn(5, 96, seed=30), randn(40, 96, seed=31)
    a, b = randn(3, 7, 24, seed=32), randn(3, 24, 9, seed=33)

    def fn(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bi.linear(x, w), bi.bmm(a, b)

    eager = fn(x, w, a, b)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)(x, w, a, b)
    for e, c in zip(eager, compiled, strict=True):
        assert_bitwise_equal(c, e, "inductor")
    torch._dynamo.reset()


def test_custom_ops_are_registered_with_fake_kernels() -> None:
    torch.library.opcheck(torch.ops.titan_audit.mm.default, (randn(4, 8, seed=34), randn(8, 3, seed=35)))
    torch.library.opcheck(torch.ops.titan_audit.bmm.default, (randn(2, 4, 8, seed=36), randn(2, 8, 3, seed=37)))
    assert_bitwise_equal(
        torch.ops.titan_audit.mm(randn(4, 8, seed=34), randn(8, 3, seed=35)),
        bi.mm(randn(4, 8, seed=34), randn(8, 3, seed=35)),
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_accuracy_against_float64(dtype: torch.dtype) -> None:
    x = randn(33, 300, seed=7, dtype=dtype)
    w = randn(70, 300, seed=8, dtype=dtype)
    b = randn(70, seed=9, dtype=dtype)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = {
        torch.float32: dict(rtol=1e-5, atol=1e-4),
        torch.bfloat16: dict(rtol=1e-2, atol=5e-2),
        torch.float64: dict(rtol=1e-12, atol=1e-12),
    }[dtype]
    torch.testing.assert_close(bi.linear(x, w, b).double(), ref, **tol)
    a3 = randn(3, 17, 40, seed=10, dtype=dtype)
    b3 = randn(3, 40, 9, seed=11, dtype=dtype)
    torch.testing.assert_close(bi.bmm(a3, b3).double(), a3.double() @ b3.double(), **tol)
    assert bi.linear(x, w, b).dtype == dtype and bi.bmm(a3, b3).dtype == dtype


def test_empty_and_degenerate_shapes() -> None:
    assert_bitwise_equal(bi.mm(torch.randn(3, 0), torch.randn(0, 4)), torch.zeros(3, 4))
    assert bi.mm(torch.randn(0, 5), torch.randn(5, 4)).shape == (0, 4)
    assert bi.bmm(torch.randn(2, 3, 5), torch.randn(2, 5, 0)).shape == (2, 3, 0)
    one = bi.mm(torch.tensor([[2.0]]), torch.tensor([[-0.0]]))
    assert one.item() == 0.0 and math.copysign(1.0, one.item()) == 1.0  # the chain starts from +0.0


def test_bad_input_names_argument_and_shape() -> None:
    with pytest.raises(ValueError, match=r"mm: expected a \[M, K\].*\(3, 4\).*\(5, 2\)"):
        bi.mm(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(ValueError, match="weight"):
        bi.linear(torch.randn(3, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="dtypes must match"):
        bi.mm(torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating"):
        bi.matmul(torch.ones(3, 4, dtype=torch.long), torch.ones(4, 2, dtype=torch.long))
