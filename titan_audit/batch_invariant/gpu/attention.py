"""Triton attention forward over a paged KV cache with a fixed split-KV size: prefill, chunked
prefill and decode run the same two kernels, so a query row gets the same bits from all three.

The order for query row (b, h, i) at position pos (base-2 scores s = (q . k_j) * scale * log2(e)):
1. Keys are cut into splits of SPLIT keys aligned to absolute key position (split s holds keys
   [s * SPLIT, (s + 1) * SPLIT)), and each split into tiles of BLOCK_N keys, also aligned.
   `_split_kernel` computes, for each split independently, the online-softmax state
   (m_s, l_s, acc_s) of the row over that split's tiles in ascending order:
     m' = max(m, max_j s_j);  a = exp2(m - m');  p_j = exp2(s_j - m')
     l = l * a + sum_j p_j;   acc = acc * a + p @ v
   A tile with no key visible to the row leaves the row's state bit-for-bit as it was (a per-row
   select, never "multiply by zero"), so keys the row cannot see (future keys, other documents,
   cache slots past the sequence, keys of other rows) never touch its bits.
2. `_combine_kernel` folds the split states in ascending split order, skipping empty splits:
     M' = max(M, m_s);  L = L * exp2(M - M') + l_s * exp2(m_s - M');  ACC likewise;  out = ACC / L
Both kernels have one compiled form per dtype: BLOCK_M (query rows per program), BLOCK_N and
SPLIT are constants, never chosen from Tq, Tk or the batch, and rows never mix inside a tile
(tl.dot rows are independent), so a row's bits do not depend on how many other rows (queries,
GQA heads, sequences) run with it, nor on the length of the cache beyond the keys it sees, nor on
which keys arrived in which chunk. Decode (Tq = 1) gets its parallelism from the splits (the
flash-decoding layout) and prefill from the rows, with the same arithmetic.

Rows: for kv head hk the Hq / Hkv query heads sharing it are packed into the row dimension
(row r = i * G + g, query head hk * G + g), so a decode step of a GQA model fills a tile with
the group's heads. Visibility of key j for a row of sequence b: j < seq_len[b]; causal: j <= pos;
doc_ids: doc[b, j] >= 0 and equal to the query's doc[b, min(pos, Tk - 1)]; extra_mask (SDPA's
attn_mask as bool "may attend" [B|1, Hq|1, Tq, Tk]). A row that sees no key gets zeros and
lse = -inf. Values of keys that no row of a tile sees are zeroed before `p @ v`; a key that
another row of the same tile sees reaches this row only as 0 * v (so a NaN or Inf held by such a
key, a broken input anyway, would reach it). lse is returned in base 2 of the scaled scores (what
the backward consumes).

Paged KV cache: k_cache / v_cache [num_pages, Hkv, PAGE, D], block_table [B, pages] (int32),
key j of sequence b at page block_table[b, j // PAGE], slot j % PAGE. The dense API
(`attention_forward`, k [B, Hkv, Tk, D]) is the one-page-per-sequence case. The page layout
changes only addresses, never the order. The paged caches call `paged_attention` in place: the
model's `PagedKVCache` (its [block, slot, kv_head, D] store as a strided [block, kv_head, slot, D]
view, through `models.ops.paged_attention`) and the vLLM backend (rl/vllm/attention.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import interpreted, jit

LOG2_E = 1.4426950408889634
# (SPLIT, BLOCK_M, BLOCK_N, warps, stages): compiled kernels, and the interpreter (small, for tests).
# Compiled: 64 query rows (wgmma on Hopper) x 32-key tiles, 8 warps: the smallest register spill
# of the configurations tried with ptxas for sm_90 (head_dim 128); measured speed: none yet.
CONFIG = (512, 64, 32, 8, 2)
INTERPRETER_CONFIG = (32, 16, 16, 1, 1)
KEY_CHUNK = CONFIG[0]
MAX_WORKSPACE_BYTES = 1 << 28  # query rows are processed in slabs so split partials stay below this


def config(t: torch.Tensor) -> tuple[int, int, int, int, int]:
    return INTERPRETER_CONFIG if interpreted(t) else CONFIG


@jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_ptr,
    pos_ptr,
    doc_ptr,
    mask_ptr,
    po_ptr,
    pm_ptr,
    pl_ptr,
    qk_scale,
    row0,
    rows,
    hkv,
    tq,
    tk_doc,
    page,
    splits,
    d,
    s_qb,
    s_qh,
    s_qt,
    s_kp,
    s_kh,
    s_kt,
    s_vp,
    s_vh,
    s_vt,
    s_bt,
    s_mb,
    s_mh,
    s_mt,
    s_mk,
    G: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_F32: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    s = tl.program_id(2)
    b = bh // hkv
    hk = bh % hkv
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of this slab
    row_ok = r < rows
    gr = row0 + r  # global row: query i = gr // G, head hk * G + gr % G
    qi = gr // G
    head = hk * G + gr % G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < d
    q = tl.load(
        q_ptr
        + b.to(tl.int64) * s_qb
        + head[:, None].to(tl.int64) * s_qh
        + qi[:, None].to(tl.int64) * s_qt
        + dd[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    pos = tl.load(pos_ptr + b.to(tl.int64) * tq + qi, mask=row_ok, other=0)
    seq = tl.load(seq_ptr + b)
    if HAS_DOC:
        qdoc = tl.load(doc_ptr + b.to(tl.int64) * tk_doc + tl.minimum(pos, tk_doc - 1), mask=row_ok, other=-1)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    start = s * SPLIT
    end = tl.minimum(start + SPLIT, seq)
    if CAUSAL:  # tiles past every row's position are no-ops for each row; skip them
        end = tl.minimum(end, tl.max(tl.where(row_ok, pos, -1), axis=0) + 1)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < seq
        blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + j // page, mask=j_ok, other=0).to(tl.int64)
        slot = (j % page).to(tl.int64)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * s_kp + hk.to(tl.int64) * s_kh + slot[:, None] * s_kt + dd[None, :],
            mask=kv_ok,
            other=0.0,
        )
        v = tl.load(
            v_ptr + blk[:, None] * s_vp + hk.to(tl.int64) * s_vh + slot[:, None] * s_vt + dd[None, :],
            mask=kv_ok,
            other=0.0,
        )
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        vis = row_ok[:, None] & j_ok[None, :]
        if CAUSAL:
            vis = vis & (j[None, :] <= pos[:, None])
        if HAS_DOC:
            kdoc = tl.load(doc_ptr + b.to(tl.int64) * tk_doc + j, mask=j_ok, other=-1)
            vis = vis & (kdoc[None, :] >= 0) & (kdoc[None, :] == qdoc[:, None])
        if HAS_MASK:
            mk = tl.load(
                mask_ptr
                + b.to(tl.int64) * s_mb
                + head[:, None].to(tl.int64) * s_mh
                + qi[:, None].to(tl.int64) * s_mt
                + j[None, :].to(tl.int64) * s_mk,
                mask=row_ok[:, None] & j_ok[None, :],
                other=0,
            )
            vis = vis & (mk != 0)
        # keys no row of the tile sees (padding, other documents) hold anything, NaN included: zero
        # their values, so p = 0 meets 0.0, never 0 * NaN
        v = tl.where((tl.max(vis.to(tl.int32), axis=0) > 0)[:, None], v, 0.0)
        sc = tl.where(vis, qk * qk_scale, float("-inf"))
        any_vis = tl.max(vis.to(tl.int32), axis=1) > 0
        m_new = tl.where(any_vis, tl.maximum(m_i, tl.max(sc, axis=1)), m_i)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # (no -inf - -inf: rows that see nothing)
        alpha = tl.where(any_vis, tl.exp2(m_i - m_ref), 1.0)
        p = tl.where(vis, tl.exp2(sc - m_ref[:, None]), 0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        l_i = tl.where(any_vis, l_i * alpha + tl.sum(p, axis=1), l_i)
        acc = tl.where(any_vis[:, None], acc * alpha[:, None] + pv, acc)
        m_i = m_new
    part = (bh.to(tl.int64) * rows + r) * splits + s
    tl.store(pm_ptr + part, m_i, mask=row_ok)
    tl.store(pl_ptr + part, l_i, mask=row_ok)
    tl.store(po_ptr + part[:, None] * d + dd[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@jit
def _combine_kernel(
    po_ptr,
    pm_ptr,
    pl_ptr,
    out_ptr,
    lse_ptr,
    row0,
    rows,
    hkv,
    splits,
    d,
    s_ob,
    s_oh,
    s_ot,
    s_lb,
    s_lh,
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hkv
    hk = bh % hkv
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    gr = row0 + r
    qi = gr // G
    head = hk * G + gr % G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < d
    big_m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    big_l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    base = (bh.to(tl.int64) * rows + r) * splits
    for s in range(0, splits):  # ascending split order
        m_s = tl.load(pm_ptr + base + s, mask=row_ok, other=float("-inf"))
        l_s = tl.load(pl_ptr + base + s, mask=row_ok, other=0.0)
        o_s = tl.load(po_ptr + (base + s)[:, None] * d + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        has = l_s > 0.0
        m_new = tl.where(has, tl.maximum(big_m, m_s), big_m)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.where(has, tl.exp2(big_m - m_ref), 1.0)
        c = tl.where(has, tl.exp2(tl.where(has, m_s, 0.0) - m_ref), 0.0)
        big_l = tl.where(has, big_l * a + l_s * c, big_l)
        acc = tl.where(has[:, None], acc * a[:, None] + o_s * c[:, None], acc)
        big_m = m_new
    seen = big_l > 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, big_l, 1.0)[:, None], 0.0)
    lse = tl.where(seen, big_m + tl.log2(tl.where(seen, big_l, 1.0)), float("-inf"))
    o_off = b.to(tl.int64) * s_ob + head[:, None].to(tl.int64) * s_oh + qi[:, None].to(tl.int64) * s_ot + dd[None, :]
    tl.store(out_ptr + o_off, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b.to(tl.int64) * s_lb + head.to(tl.int64) * s_lh + qi, lse, mask=row_ok)


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"batch_invariant (triton): attention in {q.dtype} (float32, bfloat16, float16 only)")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Tq, D] float32, lse [B, Hq, Tq] base 2) over a paged KV cache.

    q [B, Hq, Tq, D] (any strides, last dim contiguous); k_cache, v_cache [pages, Hkv, PAGE, D];
    block_table [B, n] int; seq_lens [B] int (keys present per sequence); q_positions [B, Tq]
    long; doc_ids [B, >= max seq_len] long or None; extra_mask bool [B|1, Hq|1, Tq, Tk] or None;
    max_seq_len: an upper bound of seq_lens known to the caller (saves reading seq_lens back; it
    sets only how many splits are launched: splits past a sequence's length are empty no-ops).
    """
    _check_dtype(q)
    batch, hq, tq, d = q.shape
    hkv, page = k_cache.shape[1], k_cache.shape[2]
    assert hq % hkv == 0 and k_cache.shape == v_cache.shape and k_cache.shape[3] == d
    assert k_cache.dtype == v_cache.dtype == q.dtype
    group = hq // hkv
    split, block_m, block_n, warps, stages = config(q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    bt = block_table.to(device=q.device, dtype=torch.int32).contiguous()
    seq = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    pos = q_positions.to(device=q.device, dtype=torch.int64).expand(batch, tq).contiguous()
    out = torch.empty((batch, hq, tq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, hq, tq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    max_seq = max_seq_len if max_seq_len is not None else (int(seq.max()) if seq.numel() else 0)
    if max_seq == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    splits = triton.cdiv(max_seq, split)
    doc = None if doc_ids is None else doc_ids.to(device=q.device, dtype=torch.int64).contiguous()
    tk_doc = 1 if doc is None else doc.shape[1]
    mstr = [0, 0, 0, 0]
    if extra_mask is not None:
        assert extra_mask.dtype == torch.bool and extra_mask.dim() == 4, extra_mask.shape
        mstr = [0 if extra_mask.shape[i] == 1 else extra_mask.stride(i) for i in range(4)]
    block_d = triton.next_power_of_2(d)
    interp = interpreted(q)
    opts = {} if interp else dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    rows_total = tq * group
    per_row = splits * (d + 2) * 4 * batch * hkv
    slab = max(block_m, (MAX_WORKSPACE_BYTES // max(per_row, 1)) // block_m * block_m)
    dummy = pos  # any tensor on the device for absent optional pointers
    for row0 in range(0, rows_total, slab):  # slabs of query rows: rows are independent
        rows = min(slab, rows_total - row0)
        po = torch.empty((batch * hkv, rows, splits, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((batch * hkv, rows, splits), dtype=torch.float32, device=q.device)
        pl = torch.empty((batch * hkv, rows, splits), dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(rows, block_m), batch * hkv, splits)
        _split_kernel[grid](
            q,
            k_cache,
            v_cache,
            bt,
            seq,
            pos,
            doc if doc is not None else dummy,
            extra_mask if extra_mask is not None else dummy,
            po,
            pm,
            pl,
            float(scale) * LOG2_E,
            row0,
            rows,
            hkv,
            tq,
            tk_doc,
            page,
            splits,
            d,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            bt.stride(0),
            *mstr,
            G=group,
            CAUSAL=bool(causal),
            HAS_DOC=doc is not None,
            HAS_MASK=extra_mask is not None,
            DOT_F32=interp and q.dtype != torch.float32,
            IEEE=q.dtype == torch.float32 or interp,
            SPLIT=split,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            **opts,
        )
        _combine_kernel[(triton.cdiv(rows, block_m), batch * hkv)](
            po,
            pm,
            pl,
            out,
            lse,
            row0,
            rows,
            hkv,
            splits,
            d,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            G=group,
            BLOCK_R=block_m,
            BLOCK_D=block_d,
            **({} if interp else dict(num_warps=4, enable_fp_fusion=False)),
        )
    return out, lse


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    extra_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's dense attention: k, v [B, Hkv, Tk, D] as a cache of one page per sequence."""
    _check_dtype(q)
    batch, tk = k.shape[0], k.shape[2]
    assert v.shape == k.shape, "triton attention: v must have k's shape"
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    table = torch.arange(batch, dtype=torch.int32, device=q.device).unsqueeze(1)
    seq = torch.full((batch,), tk, dtype=torch.int32, device=q.device)
    # page = max(Tk, 1): j // page == 0 for every key, so sequence b reads k[b] with its own strides
    return paged_attention(
        q, k, v, table, seq, q_positions, scale, causal=causal, doc_ids=doc_ids, extra_mask=extra_mask, max_seq_len=tk
    )


__all__ = ["KEY_CHUNK", "LOG2_E", "attention_forward", "config", "paged_attention", "math"]
