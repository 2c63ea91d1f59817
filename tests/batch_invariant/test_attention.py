"""attention: prefill == chunked prefill == decode == any batch, bitwise, on every ISA variant.

Proves, for random lengths up to 512, head_dim 4..256 (64/96/128/256 and odd ones), GQA ratios,
float32 and bfloat16: a full causal prefill, a chunked prefill with random chunk boundaries and
decode steps from a KV cache (with keys past the query present, holding NaN) give every query
row the same bits; a sample alone gives the same bits as in a batch; packed documents (doc_ids)
with NaN padding give each document the bits it gets alone; explicit q_positions agree with the
default; the scalar, avx2 and avx512 kernels (every variant this CPU has) give identical bits;
1 to 4 threads give identical bits; torch.compile runs the same kernel (same bits). Accuracy
against a float64 masked reference (float32, bfloat16, float64). Negative controls: a decode
step whose scores sum head_dim in reverse gives other bits than the same row of the prefill; the
same attention summed in another order (head_dim reversed, keys reversed) gives other bits, so
the bitwise checks tell orders apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from batch_invariant._helpers import DTYPES, num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu import _lib

HEAD_DIMS = [4, 8, 16, 33, 64, 96, 128, 256]


def _qkv(batch: int, hq: int, hkv: int, t: int, d: int, seed: int, dtype: torch.dtype = torch.float32):
    return (
        randn(batch, hq, t, d, seed=seed, dtype=dtype),
        randn(batch, hkv, t, d, seed=seed + 1, dtype=dtype),
        randn(batch, hkv, t, d, seed=seed + 2, dtype=dtype),
    )


def reference(q, k, v, *, causal=True, q_positions=None, doc_ids=None, scale=None):  # noqa: ANN001, ANN201
    """Float64 dense masked softmax attention with the same semantics as bi.attention."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(hq // hkv, 1), v.double().repeat_interleave(hq // hkv, 1)
    pos = torch.arange(tk - tq, tk).expand(b, tq) if q_positions is None else q_positions.expand(b, tq)
    keys = torch.arange(tk)
    vis = torch.ones(b, tq, tk, dtype=torch.bool)
    if causal:
        vis &= keys[None, None, :] <= pos[:, :, None]
    if doc_ids is not None:
        qdoc = torch.gather(doc_ids, 1, pos)
        vis &= (doc_ids[:, None, :] == qdoc[:, :, None]) & (doc_ids[:, None, :] >= 0)
    s = (q @ k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    s = s.masked_fill(~vis[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.slow
@settings(max_examples=100)
@given(data=st.data())
def test_prefill_chunked_prefill_and_decode_agree(data: st.DataObject) -> None:
    t = data.draw(st.integers(1, 512), label="T")
    hkv = data.draw(st.integers(1, 2), label="Hkv")
    groups = data.draw(st.sampled_from([1, 2, 3, 4]), label="G")
    d = data.draw(st.sampled_from(HEAD_DIMS), label="D")
    batch = data.draw(st.integers(1, 2), label="B")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    q, k, v = _qkv(batch, hkv * groups, hkv, t, d, seed, dtype)
    full = bi.attention(q, k, v)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, t - 1)), max_size=4), label="cuts")) - {t})
    bounds = [0, *cuts, t]
    parts = [bi.attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e]) for s, e in zip(bounds, bounds[1:])]
    assert_bitwise_equal(torch.cat(parts, dim=2), full, "chunked prefill")
    # A KV cache holding more than the row sees: keys past the query's position are present
    # (and hold NaN or -0.0) but invisible, so they must change nothing.
    for i in data.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=3), label="decode steps"):
        step = bi.attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1])
        assert_bitwise_equal(step, full[:, :, i : i + 1], f"decode step {i}")
        k_cache, v_cache = k.clone(), v.clone()
        k_cache[:, :, i + 1 :], v_cache[:, :, i + 1 :] = float("nan"), -0.0
        padded = bi.attention(q[:, :, i : i + 1], k_cache, v_cache, q_positions=torch.tensor([i]))
        assert_bitwise_equal(padded, full[:, :, i : i + 1], f"decode step {i} over a longer cache")
    j = data.draw(st.integers(0, batch - 1), label="sample")
    assert_bitwise_equal(bi.attention(q[j : j + 1], k[j : j + 1], v[j : j + 1]), full[j : j + 1], "sample alone")


def test_token_by_token_decode_matches_prefill() -> None:
    q, k, v = _qkv(2, 4, 2, 200, 128, seed=1)
    full = bi.attention(q, k, v)
    steps = [bi.attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in range(200)]
    assert_bitwise_equal(torch.cat(steps, dim=2), full)


@pytest.mark.slow
@settings(max_examples=100)
@given(data=st.data())
def test_sample_bits_do_not_depend_on_batch_padding_or_packing(data: st.DataObject) -> None:
    """A document packed with others (and padding) gets the bits it gets alone at its offset."""
    lengths = data.draw(st.lists(st.integers(1, 120), min_size=1, max_size=4), label="doc lengths")
    pad = data.draw(st.integers(0, 70), label="padding")
    d = data.draw(st.sampled_from([8, 16, 64, 128]), label="D")
    groups = data.draw(st.sampled_from([1, 2]), label="G")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    t = sum(lengths) + pad
    q, k, v = _qkv(1, 2 * groups, 2, t, d, seed)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])[None]
    k[:, :, t - pad :] = float("nan") if pad else 0.0  # padding keys may hold anything
    v[:, :, t - pad :] = float("nan") if pad else 0.0
    packed = bi.attention(q, k, v, doc_ids=doc_ids)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        # The same document alone, at the same absolute key positions (keys before it are other docs).
        alone_ids = torch.full((1, start + n), -1)
        alone_ids[:, sl] = i
        alone = bi.attention(q[:, :, sl], k[:, :, : start + n], v[:, :, : start + n], doc_ids=alone_ids)
        assert_bitwise_equal(alone, packed[:, :, sl], f"document {i}")
        start += n
    assert torch.isfinite(packed[:, :, : t - pad]).all()


def test_batch_of_different_positions_per_sample() -> None:
    """[B, Tq] q_positions: each sample decodes at its own position; rows match their own prefill."""
    q, k, v = _qkv(3, 4, 4, 300, 8, seed=2)
    full = bi.attention(q, k, v)
    pos = torch.tensor([[5], [130], [299]])
    q_step = torch.stack([q[b, :, p] for b, p in enumerate(pos[:, 0].tolist())])[:, :, None]
    step = bi.attention(q_step, k, v, q_positions=pos)
    for b, p in enumerate(pos[:, 0].tolist()):
        assert_bitwise_equal(step[b, :, 0], full[b, :, p])


@pytest.mark.slow
@settings(max_examples=40)
@given(data=st.data())
def test_every_isa_variant_gives_the_same_bits(data: st.DataObject) -> None:
    """Forward (causal, documents, non-causal) under every variant this CPU runs: identical bits.
    On a CPU with one variant only this still runs, comparing that variant with itself."""
    t = data.draw(st.integers(1, 300), label="T")
    tq = data.draw(st.integers(1, t), label="Tq")
    hkv = data.draw(st.integers(1, 2), label="Hkv")
    groups = data.draw(st.sampled_from([1, 2, 4]), label="G")
    d = data.draw(st.sampled_from(HEAD_DIMS), label="D")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    causal = data.draw(st.booleans(), label="causal")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    q, k, v = _qkv(2, hkv * groups, hkv, t, d, seed, dtype)
    q = q[:, :, t - tq :]
    cut = data.draw(st.integers(0, t), label="document boundary")
    doc_ids = torch.tensor([[0] * cut + [1] * (t - cut), [5] * (t - cut) + [-1] * cut])
    results = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            results[isa] = (bi.attention(q, k, v, causal=causal), bi.attention(q, k, v, doc_ids=doc_ids))
    first = next(iter(results.values()))
    for isa, outs in results.items():
        for a, b in zip(outs, first):
            assert_bitwise_equal(a, b, f"{isa} vs {_lib.available_isas()[0]}")


@pytest.mark.parametrize("scale", [1e-3, 0.125, 8.0, 60.0])
def test_every_isa_variant_same_bits_at_extreme_scales(scale: float) -> None:
    """Scores far apart (exp2 arguments down to its clamp, subnormal and zero p, l == 1 exactly)
    and nearly equal ones: forward and backward bits identical on every variant; finite."""
    q, k, v = _qkv(2, 4, 2, 200, 32, seed=13)
    g = randn(2, 4, 200, 32, seed=14)
    results = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = bi.attention(*leaves, scale=scale)
            (out * g).sum().backward()
            results[isa] = [out.detach(), *(x.grad for x in leaves)]
    first = results[_lib.available_isas()[0]]
    assert all(bool(torch.isfinite(x).all()) for x in first)
    for isa, tensors in results.items():
        for a, b, name in zip(tensors, first, ("out", "dq", "dk", "dv")):
            assert_bitwise_equal(a, b, f"{name}: {isa} vs scalar at scale {scale}")


def test_available_variants_include_the_portable_one() -> None:
    assert _lib.available_isas()[0] == "scalar"


def test_key_chunk_is_the_kernels() -> None:
    """The backend's KEY_CHUNK (the chunk alignment the docs and other backends rely on) is the
    one compiled into every variant."""
    from titan_audit.batch_invariant.cpu.attention import KEY_CHUNK

    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            assert _lib.kernel("attention_key_chunk")() == KEY_CHUNK == 128


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_accuracy_against_float64(dtype: torch.dtype, causal: bool) -> None:
    q, k, v = _qkv(2, 6, 2, 150, 16, seed=3, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(bi.attention(q, k, v, causal=causal).double(), reference(q, k, v, causal=causal), **tol)
    doc_ids = torch.tensor([[0] * 40 + [1] * 100 + [-1] * 10, [2] * 150])
    torch.testing.assert_close(
        bi.attention(q, k, v, doc_ids=doc_ids, scale=0.3).double(),
        reference(q, k, v, doc_ids=doc_ids, scale=0.3),
        **tol,
    )
    qp = torch.tensor([3, 70, 149])
    torch.testing.assert_close(
        bi.attention(q[:, :, :3], k, v, q_positions=qp).double(), reference(q[:, :, :3], k, v, q_positions=qp), **tol
    )
    out = bi.attention(q[:, :, :1], k, v, q_positions=torch.tensor([0]), doc_ids=torch.full((2, 150), -1))
    assert out.dtype == dtype and bool((out == 0).all()), "no visible key -> zeros"


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_accuracy_at_model_head_dims(d: int) -> None:
    q, k, v = _qkv(1, 4, 2, 300, d, seed=d)
    torch.testing.assert_close(bi.attention(q, k, v).double(), reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_float64_inputs_compute_in_float64() -> None:
    q, k, v = _qkv(2, 4, 2, 140, 24, seed=9, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 60 + [1] * 80, [0] * 130 + [-1] * 10])
    out = bi.attention(q, k, v, doc_ids=doc_ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(q, k, v, doc_ids=doc_ids), rtol=1e-12, atol=1e-12)
    steps = [bi.attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]) for i in (0, 127, 128, 139)]
    for i, step in zip((0, 127, 128, 139), steps):
        assert_bitwise_equal(step, bi.attention(q, k, v)[:, :, i : i + 1], f"float64 decode step {i}")


@pytest.mark.control
def test_negative_control_a_decode_step_in_another_order_differs() -> None:
    """The decode check can fail: each decode step computed with head_dim reversed (every score's
    fma chain runs d descending) gives other bits than the prefill's row, under the comparison
    our decode steps pass. Native SDPA's decode steps are reported, not asserted: whether they
    keep the prefill's bits depends on the CPU."""
    q, k, v = _qkv(1, 4, 4, 300, 64, seed=4)
    ours = bi.attention(q, k, v)
    steps = range(200, 300, 9)
    for i in steps:
        qi, ki, vi = q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]
        assert not bitwise_equal(bi.attention(qi.flip(-1), ki.flip(-1), vi), ours[:, :, i : i + 1]), f"step {i}"
        assert_bitwise_equal(bi.attention(qi, ki, vi), ours[:, :, i : i + 1], f"step {i}")
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    native = [
        i
        for i in steps
        if not bitwise_equal(
            F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1]),
            full[:, :, i : i + 1],
        )
    ]
    print(f"native SDPA: decode steps differing from the prefill: {len(native)} of {len(steps)}")


@pytest.mark.control
def test_negative_control_another_order_gives_other_bits() -> None:
    """The same attention, mathematically, summed in another order: head_dim reversed (each score's
    fma chain runs d descending) and keys reversed without a causal mask (other chunks, the value
    chain runs backwards). Both stay accurate and both differ in bits, so the bitwise checks above
    (variants, decode, batch) would catch a kernel whose order drifted."""
    q, k, v = _qkv(1, 4, 2, 300, 64, seed=10)
    ours = bi.attention(q, k, v, causal=False)
    flipped_d = bi.attention(q.flip(-1), k.flip(-1), v, causal=False)
    flipped_keys = bi.attention(q, k.flip(2), v.flip(2), causal=False)
    for other in (flipped_d, flipped_keys):
        torch.testing.assert_close(other, ours, rtol=1e-5, atol=1e-5)
        assert not bitwise_equal(other, ours)


def test_bad_input() -> None:
    q, k, v = _qkv(1, 3, 2, 8, 4, seed=5)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        bi.attention(q, k, v)
    with pytest.raises(ValueError, match=r"doc_ids must have shape \[1, 8\]"):
        bi.attention(q[:, :2], k, v, doc_ids=torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"q_positions must have shape"):
        bi.attention(q[:, :2], k, v, q_positions=torch.arange(3))
    with pytest.raises(ValueError, match="q must be 4-D"):
        bi.attention(q[0], k, v)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_thread_count_does_not_change_bits(threads: int) -> None:
    """Prefill and decode at 1 thread and at `threads` (3 and 4 oversubscribe this 2-core
    machine, on purpose)."""
    q, k, v = _qkv(2, 8, 2, 300, 32, seed=6)
    with num_threads(1):
        one = [bi.attention(q, k, v), bi.attention(q[:, :, -1:], k, v)]
    with num_threads(threads):
        many = [bi.attention(q, k, v), bi.attention(q[:, :, -1:], k, v)]
    for a, b in zip(one, many):
        assert_bitwise_equal(a, b, f"1 vs {threads} threads")


def test_sdpa_in_mode_gqa_and_bool_mask() -> None:
    q, k, v = _qkv(2, 8, 2, 90, 16, seed=7)
    mask = randn(2, 1, 90, 90, seed=8) > -0.5
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    expected = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=mask)
    with bi.enabled():
        assert_bitwise_equal(
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), bi.attention(q, k, v)
        )
        masked = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        one = F.scaled_dot_product_attention(q[1:], kk[1:], vv[1:], attn_mask=mask[1:])
    torch.testing.assert_close(masked.double(), expected, rtol=1e-5, atol=1e-5)
    assert_bitwise_equal(one, masked[1:], "sample alone with a bool mask")


def test_custom_op_under_torch_compile_gives_the_eager_bits() -> None:
    """Under torch.compile the kernel runs as the custom op titan_audit::attention_fwd (its
    register_fake gives the shapes): the same bits as eager."""
    q, k, v = _qkv(1, 4, 2, 40, 16, seed=12)
    positions = torch.arange(40).expand(1, 40).contiguous()
    ours = bi.attention(q, k, v)
    op = torch.ops.titan_audit.attention_fwd
    out, lse = op(q, k, v, 0.25, True, positions, None, None)
    assert_bitwise_equal(out, ours, "custom op vs eager")
    torch.library.opcheck(
        op, (q, k, v, 0.25, True, positions, None, None), test_utils=("test_schema", "test_faketensor")
    )
    g = randn(1, 4, 40, 16, seed=13)
    bwd_args = (g, q, k, v, out, lse, 0.25, True, positions, None, None)
    torch.library.opcheck(torch.ops.titan_audit.attention_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (bi.attention(*leaves) * g).sum().backward()
    for got, leaf in zip(torch.ops.titan_audit.attention_bwd(*bwd_args), leaves):
        assert_bitwise_equal(got, leaf.grad, "custom backward op vs eager autograd")
    compiled = torch.compile(lambda q, k, v: bi.attention(q, k, v), backend="eager", fullgraph=True)
    assert_bitwise_equal(compiled(q, k, v), ours, "torch.compile")
