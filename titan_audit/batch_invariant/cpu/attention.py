"""CPU attention whose output row depends only on its query, its visible keys and their positions.

Why this is invariant. Keys are reduced in chunks of `KEY_CHUNK` keys aligned to absolute key
positions: chunk c always holds keys [c*C, (c+1)*C), in ascending order, whatever the number of
queries (prefill, chunked prefill, decode) or keys present. The cache is padded with zero keys
to a whole number of chunks, so every reduction inside a chunk has the same length C whether
the chunk is full (prefill) or only partly filled (decode with a short cache). Per chunk, with
an online softmax in float32 (m: running max, acc: running [sum p*v, sum p]):

    s    = (q * scale) . k_c          gemm over head_dim D (row-invariant, see matmul.py)
    s    = -inf where the key is not visible (causal / document / padding / past the cache)
    m'   = max(m, rowmax(s)) + 0.0    exact, order-free
    p    = exp(s - m'),  alpha = exp(m - m')
    acc  = acc * alpha + p @ [v_c, 1] gemm over the C keys of the chunk (row-invariant)

The row sum of p is the extra ones column of the same gemm, so numerator and denominator share
one fixed order. A key the query cannot see has p == 0 exactly, so it adds an exact zero; a
chunk with no visible key gives alpha == 1 and adds zeros, an exact no-op up to the sign of a
zero. Chunks that no row of a block can see (causal) are skipped for the rows that cannot see
them, which changes nothing for the same reason; the output gets `+ 0.0` so the sign of a zero
never depends on which chunks were skipped. GQA folds the G query heads of one kv head into the
gemm's rows, which the row-invariant gemm allows. Values at keys a query cannot see are
multiplied by an exact zero, so they must be finite; padding keys (doc_ids < 0) are zeroed first.

The backward (`attention_backward`) recomputes p per chunk from the saved log-sum-exp and walks
the chunks in the same ascending order: dq accumulates per row over chunks (row-invariant);
dk and dv are sums over query rows (deterministic: fixed shapes, fixed order).
"""

from __future__ import annotations

import torch

from titan_audit.batch_invariant.cpu.matmul import bmm
from titan_audit.batch_invariant.cpu.reductions import tree_sum

KEY_CHUNK = 64


def _chunks(num_keys: int) -> int:
    return -(-num_keys // KEY_CHUNK)


def _pad_keys(x: torch.Tensor, num_padded: int) -> torch.Tensor:
    """[B, H, Tk, D] -> [B, H, num_padded, D] with zero keys after the real ones."""
    if x.shape[2] == num_padded:
        return x
    out = x.new_zeros((*x.shape[:2], num_padded, x.shape[3]))
    out[:, :, : x.shape[2]] = x
    return out


class _Masker:
    """Visibility of chunk keys for query rows: causal, document and padding rules."""

    def __init__(
        self,
        q_positions: torch.Tensor,
        num_keys: int,
        causal: bool,
        doc_ids: torch.Tensor | None,
        extra_mask: torch.Tensor | None,
    ) -> None:
        self.q_positions = q_positions  # [B, Tq] long
        self.num_keys = num_keys
        self.causal = causal
        self.doc_ids = doc_ids  # [B, Tk] long or None
        if doc_ids is not None:
            index = q_positions.clamp(0, num_keys - 1)
            self.q_doc = torch.gather(doc_ids, 1, index)  # [B, Tq]
        self.extra_mask = extra_mask  # bool [B or 1, H or 1, Tq, Tk] (SDPA attn_mask) or None
        # cummax of the latest position per row: rows before first_row(c) cannot see chunk c.
        self.reach = torch.cummax(q_positions.amax(dim=0), dim=0).values

    def first_row(self, start: int) -> int:
        if not self.causal:
            return 0
        return int(torch.searchsorted(self.reach, start))

    def visible(self, r0: int, start: int) -> torch.Tensor:
        """bool [B, Tq - r0, C]: may query row r0+i see key start+j."""
        keys = torch.arange(start, start + KEY_CHUNK)
        pos = self.q_positions[:, r0:, None]
        vis = (keys < self.num_keys).expand(pos.shape[0], pos.shape[1], KEY_CHUNK)
        if self.causal:
            vis = vis & (keys <= pos)
        if self.doc_ids is not None:
            stop = min(start + KEY_CHUNK, self.num_keys)
            docs = torch.full((pos.shape[0], KEY_CHUNK), -1, dtype=torch.long)
            docs[:, : stop - start] = self.doc_ids[:, start:stop]
            vis = vis & (docs[:, None, :] == self.q_doc[:, r0:, None]) & (docs[:, None, :] >= 0)
        return vis

    def visible_heads(self, r0: int, start: int, hkv: int, groups: int) -> torch.Tensor:
        """bool broadcastable to [B, Hkv, G, Tq - r0, C]."""
        vis = self.visible(r0, start)[:, None, None]
        if self.extra_mask is not None:
            stop = min(start + KEY_CHUNK, self.num_keys)
            m = self.extra_mask[:, :, r0:, start:stop]
            full = torch.zeros((*m.shape[:3], KEY_CHUNK), dtype=torch.bool)
            full[..., : stop - start] = m
            b, h = full.shape[:2]
            full = full.reshape(b, hkv if h != 1 else 1, groups if h != 1 else 1, *full.shape[2:])
            vis = vis & full
        return vis


def _rows(x: torch.Tensor, r0: int) -> torch.Tensor:
    """[B, Hkv, G, Tq, X] -> [B*Hkv, G*(Tq-r0), X]: the gemm rows of one kv head."""
    b, hkv, g, _, width = x.shape
    return x[:, :, :, r0:].reshape(b * hkv, -1, width)


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
    """(out [B, Hq, Tq, D] float32, lse [B, Hq, Tq] float32; -inf where no key is visible)."""
    batch, hq, tq, dim = q.shape
    hkv, tk, dim_v = k.shape[1], k.shape[2], v.shape[3]
    groups = hq // hkv
    nchunks = _chunks(tk)
    masker = _Masker(q_positions, tk, causal, doc_ids, extra_mask)
    qs = (q.float() * scale).reshape(batch, hkv, groups, tq, dim)
    k = _pad_keys(k.float(), nchunks * KEY_CHUNK)
    v_aug = torch.ones((batch, hkv, nchunks * KEY_CHUNK, dim_v + 1))
    v_aug[:, :, :tk, :dim_v] = v
    v_aug[:, :, tk:, :dim_v] = 0.0
    if doc_ids is not None:
        v_aug[:, :, :tk, :dim_v].masked_fill_((doc_ids < 0)[:, None, :, None], 0.0)
    m = torch.full((batch, hkv, groups, tq), float("-inf"))
    acc = torch.zeros((batch, hkv, groups, tq, dim_v + 1))
    for c in range(nchunks):
        start = c * KEY_CHUNK
        r0 = masker.first_row(start)
        if r0 >= tq:
            break
        rows = tq - r0
        k_c = k[:, :, start : start + KEY_CHUNK].reshape(batch * hkv, KEY_CHUNK, dim)
        s = bmm(_rows(qs, r0), k_c.transpose(1, 2)).view(batch, hkv, groups, rows, KEY_CHUNK)
        s = s.masked_fill(~masker.visible_heads(r0, start, hkv, groups), float("-inf"))
        m_old = m[:, :, :, r0:]
        m_new = torch.maximum(m_old, s.amax(dim=-1)) + 0.0
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        alpha = torch.exp(m_old - m_safe)
        v_c = v_aug[:, :, start : start + KEY_CHUNK].reshape(batch * hkv, KEY_CHUNK, dim_v + 1)
        pv = bmm(p.reshape(batch * hkv, groups * rows, KEY_CHUNK), v_c)
        acc_rows = acc[:, :, :, r0:]
        acc_rows.mul_(alpha.unsqueeze(-1)).add_(pv.view(batch, hkv, groups, rows, dim_v + 1))
        m_old.copy_(m_new)
    denom = acc[..., dim_v:]
    out = torch.where(denom > 0, acc[..., :dim_v] / denom, 0.0) + 0.0
    lse = torch.where(denom[..., 0] > 0, m + torch.log(denom[..., 0]), float("-inf"))
    return out.reshape(batch, hq, tq, dim_v), lse.reshape(batch, hq, tq)


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
    """(dq, dk, dv) in float32, walking the key chunks in the forward's order."""
    batch, hq, tq, dim = q.shape
    hkv, tk, dim_v = k.shape[1], k.shape[2], v.shape[3]
    groups = hq // hkv
    nchunks = _chunks(tk)
    padded = nchunks * KEY_CHUNK
    masker = _Masker(q_positions, tk, causal, doc_ids, extra_mask)
    qs = (q.float() * scale).reshape(batch, hkv, groups, tq, dim)
    k = _pad_keys(k.float(), padded)
    v = _pad_keys(v.float(), padded)
    if doc_ids is not None:
        v[:, :, :tk].masked_fill_((doc_ids < 0)[:, None, :, None], 0.0)
    g = grad_out.float().reshape(batch, hkv, groups, tq, dim_v)
    delta = tree_sum(g * out.float().reshape(batch, hkv, groups, tq, dim_v))
    lse = lse.float().reshape(batch, hkv, groups, tq)
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse)  # p = exp(-inf) = 0 there
    dq = torch.zeros((batch, hkv, groups, tq, dim))
    dk = torch.zeros((batch, hkv, padded, dim))
    dv = torch.zeros((batch, hkv, padded, dim_v))
    for c in range(nchunks):
        start = c * KEY_CHUNK
        r0 = masker.first_row(start)
        if r0 >= tq:
            break
        rows = tq - r0
        k_c = k[:, :, start : start + KEY_CHUNK].reshape(batch * hkv, KEY_CHUNK, dim)
        v_c = v[:, :, start : start + KEY_CHUNK].reshape(batch * hkv, KEY_CHUNK, dim_v)
        q_rows = _rows(qs, r0)
        g_rows = _rows(g, r0)
        s = bmm(q_rows, k_c.transpose(1, 2)).view(batch, hkv, groups, rows, KEY_CHUNK)
        s = s.masked_fill(~masker.visible_heads(r0, start, hkv, groups), float("-inf"))
        p = torch.exp(s - lse_safe[:, :, :, r0:, None])
        dp = bmm(g_rows, v_c.transpose(1, 2)).view(batch, hkv, groups, rows, KEY_CHUNK)
        ds = (p * (dp - delta[:, :, :, r0:, None])).reshape(batch * hkv, groups * rows, KEY_CHUNK)
        dq[:, :, :, r0:].add_(bmm(ds, k_c).view(batch, hkv, groups, rows, dim))
        p = p.reshape(batch * hkv, groups * rows, KEY_CHUNK)
        dk[:, :, start : start + KEY_CHUNK] = bmm(ds.transpose(1, 2), q_rows).view(batch, hkv, KEY_CHUNK, dim)
        dv[:, :, start : start + KEY_CHUNK] = bmm(p.transpose(1, 2), g_rows).view(batch, hkv, KEY_CHUNK, dim_v)
    dq = (dq * scale + 0.0).reshape(batch, hq, tq, dim)
    return dq, dk[:, :, :tk] + 0.0, dv[:, :, :tk] + 0.0
