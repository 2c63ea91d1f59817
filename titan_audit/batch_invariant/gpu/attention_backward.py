"""Triton attention backward, deterministic: no atomics, every sum in a fixed order.

From the forward's out and base-2 lse (`attention.py`), with p_rj = exp2(s_rj - lse_r) recomputed
tile by tile (s in base 2, as in the forward) and delta_r = sum_d dO_r * O_r:
- `_delta_kernel`: delta per query row, one row's sum by one fixed lane tree (tl.sum over D).
- `_dq_kernel`: one program per (block of query rows, kv head); key tiles of BLOCK_N ascending;
    ds = p * (dO @ V^T - delta);  dq += ds @ K;  dq *= scale at the end.
  A tile the row cannot see leaves its dq bit-for-bit unchanged (a per-row select), so dq of a
  row depends only on that row and the keys it sees: batch-invariant like the forward.
- `_dkv_kernel`: one program per (block of keys, kv head); query-row tiles ascending over the
  rows r = i * G + g of the kv head's group (all query heads that read it, all queries):
    dv += p^T @ dO;  dk += (p * (dO @ V^T - delta))^T @ Q;  dk *= scale at the end.
  dk and dv are sums over query rows in that fixed order: deterministic, and (as every gradient
  of a shared operand) dependent on which rows are in the batch.
Tile sizes are constants per compiled kind (`CONFIG`), never derived from the problem's shape.
Masks are the forward's (causal, doc_ids, extra_mask), dense k/v [B, Hkv, Tk, D] only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import interpreted, jit
from titan_audit.batch_invariant.gpu.attention import LOG2_E

CONFIG = (32, 32, 4, 2)  # BLOCK_M, BLOCK_N, warps, stages
INTERPRETER_CONFIG = (16, 16, 1, 1)


@jit
def _visible(
    j,
    j_ok,
    row_ok,
    pos,
    qdoc,
    b,
    head,
    qi,
    doc_ptr,
    mask_ptr,
    tk,
    s_mb,
    s_mh,
    s_mt,
    s_mk,
    CAUSAL: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    vis = row_ok[:, None] & j_ok[None, :]
    if CAUSAL:
        vis = vis & (j[None, :] <= pos[:, None])
    if HAS_DOC:
        kdoc = tl.load(doc_ptr + b.to(tl.int64) * tk + j, mask=j_ok, other=-1)
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
    return vis


@jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, n_rows, d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dd = tl.arange(0, BLOCK_D)
    ok = (r < n_rows)[:, None] & (dd < d)[None, :]
    off = r[:, None].to(tl.int64) * d + dd[None, :]
    o = tl.load(o_ptr + off, mask=ok, other=0.0)
    do = tl.load(do_ptr + off, mask=ok, other=0.0)
    tl.store(delta_ptr + r, tl.sum(o * do, axis=1), mask=r < n_rows)


@jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    pos_ptr,
    doc_ptr,
    mask_ptr,
    dq_ptr,
    qk_scale,
    scale,
    hq,
    hkv,
    tq,
    tk,
    d,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hkv
    hk = bh % hkv
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < tq * G
    qi = r // G
    head = hk * G + r % G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < d
    row_off = (b * hq + head).to(tl.int64) * tq + qi  # row index in [B, Hq, Tq]
    q = tl.load(q_ptr + row_off[:, None] * d + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_ptr + row_off[:, None] * d + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + row_off, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + row_off, mask=row_ok, other=0.0)
    pos = tl.load(pos_ptr + b.to(tl.int64) * tq + qi, mask=row_ok, other=0)
    qdoc = pos
    if HAS_DOC:
        qdoc = tl.load(doc_ptr + b.to(tl.int64) * tk + tl.minimum(pos, tk - 1), mask=row_ok, other=-1)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    kv_base = (b * hkv + hk).to(tl.int64) * tk
    end = tk
    if CAUSAL:
        end = tl.minimum(end, tl.max(tl.where(row_ok, pos, -1), axis=0) + 1)
    for j0 in range(0, end, BLOCK_N):  # key tiles, ascending
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < tk
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (kv_base + j)[:, None] * d + dd[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + (kv_base + j)[:, None] * d + dd[None, :], mask=kv_ok, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        vis = _visible(
            j,
            j_ok,
            row_ok,
            pos,
            qdoc,
            b,
            head,
            qi,
            doc_ptr,
            mask_ptr,
            tk,
            s_mb,
            s_mh,
            s_mt,
            s_mk,
            CAUSAL,
            HAS_DOC,
            HAS_MASK,
        )
        seen = (tl.max(vis.to(tl.int32), axis=0) > 0)[:, None]  # keys some row of the tile sees
        k = tl.where(seen, k, 0.0)
        v = tl.where(seen, v, 0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        p = tl.where(vis, tl.exp2(tl.where(vis, qk * qk_scale, 0.0) - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            upd = tl.dot(ds, k, input_precision="ieee")
        else:
            upd = tl.dot(ds.to(k.dtype), k)
        any_vis = tl.max(vis.to(tl.int32), axis=1) > 0
        dq = tl.where(any_vis[:, None], dq + upd, dq)
    dq = dq * scale
    tl.store(dq_ptr + row_off[:, None] * d + dd[None, :], dq, mask=row_ok[:, None] & d_ok[None, :])


@jit
def _dkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    pos_ptr,
    doc_ptr,
    mask_ptr,
    dk_ptr,
    dv_ptr,
    qk_scale,
    scale,
    hq,
    hkv,
    tq,
    tk,
    d,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // hkv
    hk = bh % hkv
    j = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = j < tk
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < d
    kv_ok = j_ok[:, None] & d_ok[None, :]
    kv_base = (b * hkv + hk).to(tl.int64) * tk
    k = tl.load(k_ptr + (kv_base + j)[:, None] * d + dd[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + (kv_base + j)[:, None] * d + dd[None, :], mask=kv_ok, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for r0 in range(0, tq * G, BLOCK_M):  # query-row tiles of the group, ascending
        r = r0 + tl.arange(0, BLOCK_M)
        row_ok = r < tq * G
        qi = r // G
        head = hk * G + r % G
        row_off = (b * hq + head).to(tl.int64) * tq + qi
        q = tl.load(q_ptr + row_off[:, None] * d + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        do = tl.load(do_ptr + row_off[:, None] * d + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_ptr + row_off, mask=row_ok, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + row_off, mask=row_ok, other=0.0)
        pos = tl.load(pos_ptr + b.to(tl.int64) * tq + qi, mask=row_ok, other=0)
        qdoc = pos
        if HAS_DOC:
            qdoc = tl.load(doc_ptr + b.to(tl.int64) * tk + tl.minimum(pos, tk - 1), mask=row_ok, other=-1)
        if DOT_F32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        vis = _visible(
            j,
            j_ok,
            row_ok,
            pos,
            qdoc,
            b,
            head,
            qi,
            doc_ptr,
            mask_ptr,
            tk,
            s_mb,
            s_mh,
            s_mt,
            s_mk,
            CAUSAL,
            HAS_DOC,
            HAS_MASK,
        )
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        p = tl.where(vis, tl.exp2(tl.where(vis, qk * qk_scale, 0.0) - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dv += tl.dot(tl.trans(p), do, input_precision="ieee")
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
        else:
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk = dk * scale
    tl.store(dk_ptr + (kv_base + j)[:, None] * d + dd[None, :], dk, mask=kv_ok)
    tl.store(dv_ptr + (kv_base + j)[:, None] * d + dd[None, :], dv, mask=kv_ok)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    extra_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float32 from the forward's out and base-2 lse."""
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"batch_invariant (triton): attention backward in {q.dtype}")
    batch, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    do = grad_out.to(q.dtype).contiguous()
    o = out.to(torch.float32).contiguous()
    lse = lse.to(torch.float32).contiguous()
    pos = q_positions.to(device=q.device, dtype=torch.int64).expand(batch, tq).contiguous()
    dq = torch.zeros((batch, hq, tq, d), dtype=torch.float32, device=q.device)
    dk = torch.zeros((batch, hkv, tk, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros((batch, hkv, tk, d), dtype=torch.float32, device=q.device)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq, dk, dv
    interp = interpreted(q)
    block_m, block_n, warps, stages = INTERPRETER_CONFIG if interp else CONFIG
    opts = {} if interp else dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    block_d = triton.next_power_of_2(d)
    n_rows = batch * hq * tq
    delta = torch.empty(n_rows, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(n_rows, block_m),)](
        o,
        do.to(torch.float32),
        delta,
        n_rows,
        d,
        BLOCK_R=block_m,
        BLOCK_D=block_d,
        **({} if interp else dict(num_warps=4, enable_fp_fusion=False)),
    )
    doc = None if doc_ids is None else doc_ids.to(device=q.device, dtype=torch.int64).contiguous()
    mstr = [0, 0, 0, 0]
    if extra_mask is not None:
        mstr = [0 if extra_mask.shape[i] == 1 else extra_mask.stride(i) for i in range(4)]
    dummy = pos
    common = dict(
        G=group,
        CAUSAL=bool(causal),
        HAS_DOC=doc is not None,
        HAS_MASK=extra_mask is not None,
        DOT_F32=interp and q.dtype != torch.float32,
        IEEE=q.dtype == torch.float32 or interp,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **opts,
    )
    args = (float(scale) * LOG2_E, float(scale), hq, hkv, tq, tk, d, *mstr)
    ptrs = (
        q,
        k,
        v,
        do,
        lse,
        delta,
        pos,
        doc if doc is not None else dummy,
        extra_mask if extra_mask is not None else dummy,
    )
    _dq_kernel[(triton.cdiv(tq * group, block_m), batch * hkv)](*ptrs, dq, *args, **common)
    _dkv_kernel[(triton.cdiv(tk, block_n), batch * hkv)](*ptrs, dk, dv, *args, **common)
    return dq, dk, dv
