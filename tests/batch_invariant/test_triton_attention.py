"""Triton attention in Triton's interpreter on CPU tensors (marker `triton`).

Proves, bitwise, for float32 and bfloat16 with GQA: a full causal prefill, a chunked prefill
into a paged KV cache (scattered pages, chunk boundaries off the split and tile boundaries) and
token-by-token decode from that cache give every query row the same bits; a sequence alone gets
the bits it gets in a batch with a longer one; packed documents (doc_ids, with padding keys
holding NaN) give each document the bits it gets alone; cache slots past the sequence (NaN)
never reach a row; hypothesis varies the length, GQA ratio, head dim, page size and chunk cut. The
backward (through bi.attention's autograd) gives a query row the same dq alone as in the batch, and
dk / dv are the same on every run. Results match a float64 masked reference within the dtype's
tolerance. Negative control: another split size gives other bits, so the bitwise checks can fail
(and the split size is what a decode must share with a prefill).
"""

from __future__ import annotations

import pytest
import torch
from batch_invariant._helpers import randn
from batch_invariant._triton import close, triton_on_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal

pytestmark = [pytest.mark.triton, pytest.mark.slow]  # the interpreter: 4 to 13 s a test

B, HQ, HKV, T, D = 2, 4, 2, 45, 16  # 45 keys: two 32-key splits in the interpreter's config
PAGE = 8


def reference(q, k, v, positions, doc_ids=None):  # noqa: ANN001, ANN201
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(g, 1) for x in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    j = torch.arange(k.shape[2])
    vis = j[None, None, None, :] <= positions[:, None, :, None]
    if doc_ids is not None:
        qdoc = doc_ids.gather(1, positions.clamp(max=k.shape[2] - 1))
        vis = vis & (doc_ids[:, None, None, :] == qdoc[:, None, :, None]) & (doc_ids >= 0)[:, None, None, :]
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return p @ vv.nan_to_num(0.0)


def _qkv(dtype: torch.dtype, seed: int = 0):  # noqa: ANN202
    return (
        randn(B, HQ, T, D, seed=seed, dtype=dtype),
        randn(B, HKV, T, D, seed=seed + 1, dtype=dtype),
        randn(B, HKV, T, D, seed=seed + 2, dtype=dtype),
    )


class PagedCache:
    """A paged KV cache: pages handed out in a scrambled order, unwritten slots full of NaN."""

    def __init__(self, dtype: torch.dtype, pages_per_seq: int) -> None:
        n = B * pages_per_seq
        self.k = torch.full((n, HKV, PAGE, D), float("nan"), dtype=dtype)
        self.v = torch.full((n, HKV, PAGE, D), float("nan"), dtype=dtype)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(5))
        self.table = order.reshape(B, pages_per_seq).to(torch.int32)
        self.lens = torch.zeros(B, dtype=torch.int32)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # k, v [B, HKV, n, D]
        for b in range(B):
            for t in range(k.shape[2]):
                j = int(self.lens[b]) + t
                page, slot = self.table[b, j // PAGE], j % PAGE
                self.k[page, :, slot] = k[b, :, t]
                self.v[page, :, slot] = v[b, :, t]
        self.lens += k.shape[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_equals_chunked_prefill_equals_decode(dtype: torch.dtype) -> None:
    q, k, v = _qkv(dtype)
    positions = torch.arange(T).expand(B, T)
    with triton_on_cpu() as be:
        full = bi.attention(q, k, v)  # causal prefill, dense keys
        cache = PagedCache(dtype, pages_per_seq=-(-T // PAGE))
        pieces = []
        bounds = [0, 13, 37, T]  # chunks of 13, 24, 8 keys: off every split / tile / page boundary
        for lo, hi in zip(bounds, bounds[1:]):
            cache.append(k[:, :, lo:hi], v[:, :, lo:hi])
            out, _ = be.paged_attention(
                q[:, :, lo:hi], cache.k, cache.v, cache.table, cache.lens, positions[:, lo:hi], D**-0.5
            )
            pieces.append(out.to(dtype))
        assert_bitwise_equal(torch.cat(pieces, dim=2), full)
        decode = PagedCache(dtype, pages_per_seq=-(-T // PAGE))
        for t in range(T - 2, T):  # the last decode steps; earlier keys written as one prefill
            if t == T - 2:
                decode.append(k[:, :, :t], v[:, :, :t])
            decode.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
            out, _ = be.paged_attention(
                q[:, :, t : t + 1], decode.k, decode.v, decode.table, decode.lens, positions[:, t : t + 1], D**-0.5
            )
            assert_bitwise_equal(out.to(dtype), full[:, :, t : t + 1])
    close(full, reference(q, k, v, positions), dtype)


def test_sequence_alone_equals_sequence_in_batch_and_docs() -> None:
    q, k, v = _qkv(torch.float32, seed=10)
    with triton_on_cpu():
        full = bi.attention(q, k, v)
        short = 29  # sequence 1 alone, shorter: fewer splits, fewer tiles, another batch
        assert_bitwise_equal(bi.attention(q[1:, :, :short], k[1:, :, :short], v[1:, :, :short]), full[1:, :, :short])
        doc_ids = torch.tensor([[0] * 20 + [1] * 22 + [-1] * 3, [2] * 45])
        kn, vn = k.clone(), v.clone()
        kn[0, :, 42:], vn[0, :, 42:] = float("nan"), float("nan")  # padding keys: never visible
        packed = bi.attention(q, kn, vn, doc_ids=doc_ids)
        second = bi.attention(q[:1, :, 20:42], k[:1, :, 20:42], v[:1, :, 20:42])  # doc 1 alone at 0
        assert_bitwise_equal(
            packed[:1, :, 20:42],
            bi.attention(
                q[:1, :, 20:42],
                k[:1, :, :42],
                v[:1, :, :42],
                q_positions=torch.arange(20, 42),
                doc_ids=doc_ids[:1, :42],
            ),
        )
        assert torch.isfinite(packed[:, :, :42]).all()
    positions = torch.arange(T).expand(B, T)
    close(packed[:, :, :42], reference(q, kn, vn, positions, doc_ids)[:, :, :42], torch.float32)
    close(
        second,
        reference(q[:1, :, 20:42], k[:1, :, 20:42], v[:1, :, 20:42], torch.arange(22).expand(1, 22)),
        torch.float32,
    )


def test_backward_row_invariant_and_deterministic() -> None:
    q, k, v = _qkv(torch.float32, seed=20)
    g = randn(B, HQ, T, D, seed=23)
    t = 30
    with triton_on_cpu():
        runs = []
        for _ in range(2):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            bi.attention(qq, kk, vv).backward(g)
            runs.append((qq.grad, kk.grad, vv.grad))
        for a, b in zip(*runs):
            assert_bitwise_equal(a, b)
        qq = q[:1, :, t : t + 1].clone().requires_grad_()
        bi.attention(qq, k[:1], v[:1], q_positions=torch.arange(t, t + 1)).backward(g[:1, :, t : t + 1])
        assert_bitwise_equal(qq.grad, runs[0][0][:1, :, t : t + 1])
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    reference(qq, kk, vv, torch.arange(T).expand(B, T)).backward(g.double())
    for got, want in zip(runs[0], (qq.grad, kk.grad, vv.grad)):
        close(got, want, torch.float32)


def test_negative_control_other_split_size_changes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_audit.batch_invariant.gpu import attention

    q, k, v = _qkv(torch.float32, seed=30)
    with triton_on_cpu():
        one = bi.attention(q, k, v)
        monkeypatch.setattr(attention, "INTERPRETER_CONFIG", (16, 16, 16, 1, 1))
        other = bi.attention(q, k, v)
    assert not bitwise_equal(one, other)
    close(other, reference(q, k, v, torch.arange(T).expand(B, T)), torch.float32)


@settings(max_examples=5)
@given(
    t=st.integers(1, 40),
    group=st.sampled_from([1, 2]),
    d=st.sampled_from([8, 16]),
    page=st.sampled_from([4, 8, 64]),
    cut=st.data(),
)
def test_property_chunked_paged_equals_prefill(t: int, group: int, d: int, page: int, cut: st.DataObject) -> None:
    c = cut.draw(st.integers(0, t - 1))
    hkv = 1
    q = randn(1, hkv * group, t, d, seed=t * 7 + d)
    k, v = randn(1, hkv, t, d, seed=t + 1), randn(1, hkv, t, d, seed=t + 2)
    pages = -(-t // page)
    kc = torch.full((pages, hkv, page, d), float("nan"))
    vc = kc.clone()
    j = torch.arange(t)
    table = torch.arange(pages - 1, -1, -1, dtype=torch.int32).unsqueeze(0)  # pages in reverse order
    kc[table[0, j // page].long(), :, j % page] = k[0].transpose(0, 1)
    vc[table[0, j // page].long(), :, j % page] = v[0].transpose(0, 1)
    positions = torch.arange(t).unsqueeze(0)
    with triton_on_cpu() as be:
        full = bi.attention(q, k, v)
        pieces = []
        for lo, hi in ((0, c), (c, t)):
            if hi > lo:
                lens = torch.tensor([hi], dtype=torch.int32)
                pieces.append(be.paged_attention(q[:, :, lo:hi], kc, vc, table, lens, positions[:, lo:hi], d**-0.5)[0])
    assert_bitwise_equal(torch.cat(pieces, dim=2), full)
    close(full, reference(q, k, v, positions), torch.float32)
