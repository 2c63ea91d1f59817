"""CPU attention whose output row depends only on its query, its visible keys and their positions.

Why this is invariant. Keys are reduced in chunks of `KEY_CHUNK` (C = 128) keys aligned to
absolute key positions: chunk c always holds keys [c*C, (c+1)*C), in ascending order, whatever
the number of queries (prefill, chunked prefill, decode) or keys present. A chunk that runs past
the cache is padded with zero keys, so every reduction inside a chunk has the same length C
whether the chunk is full (prefill) or only partly filled (decode with a short cache). Per chunk,
an online softmax in float32 (m: running max, l: running sum of p, acc: running sum of p*v):

    s    = (q * scale * log2(e)) . k_c   gemm over head_dim D (row-invariant, see matmul.py)
    s    = -inf where the key is not visible (causal / document / padding / past the cache)
    m'   = max(m, rowmax(s)) + 0.0       exact, order-free
    p    = 2**(s - m'),  alpha = 2**(m - m')
    l    = l * alpha + tree_sum(p)       fixed pairwise tree over the C keys (reductions.py)
    acc  = acc * alpha + p @ v_c         gemm over the C keys of the chunk (row-invariant)

and out = acc / l, lse = (m + log2(l)) * ln(2). Scores are in base 2 (the scale folded into q)
because 2**x is about 4x cheaper than e**x here; it runs on buffers whose length gives every
element the vector routine (exp2.py: torch.exp2 rounds a buffer's left-over tail differently, so
plain exp2 would make a row's bits depend on where it sits). A key the query cannot see has p ==
0 exactly, so it adds an exact zero; a chunk with no visible key gives alpha == 1 and adds
zeros, an exact no-op up to the sign of a zero. Chunks that no row of a query block can see
(causal) are skipped, which changes nothing for the same reason; the output gets `+ 0.0` so the
sign of a zero never depends on which chunks were skipped. GQA folds the G query heads of one kv
head into the gemm's rows, which the row-invariant gemm allows; the rows of all (batch, kv head)
pairs sit in one zero-padded [B*Hkv, R, D] buffer (R: the row count `matmul.padded_rows` gives,
so a decode step's one or few rows per head run in the same >= 4-row kernel family as a
prefill's many; padding rows are separate outputs and never read back, so they may hold anything
finite or not). The cost: a decode step of one row per kv head (MHA) pays for 4 rows in both
gemms. No cheaper exact form exists here: with queries as columns instead, MKL's < 12-column
paths give other bits than its wide path (and, measured, even depend on the batch count); MKL's
1- to 3-row paths differ from its >= 4-row path even at K = 64 and 128 (measured).

The scores of a group of chunks come from one gemm (an output column's bits do not depend on
the other columns: measured, tested in test_matmul.py); the reduction over keys (p @ v) is
never merged across chunks: it is one [R, C] @ [C, D] gemm per chunk, on a strided view of p
(the row stride does not change bits, see matmul.py), added into acc by `baddbmm_` (MKL adds
the finished product to acc, one rounding per element: the bits of `acc + p @ v_c`, measured
and tested). How many chunks form a group depends on the block's size, for speed only; the
bits of a row do not. Hidden scores are set to -inf either by the general mask or, for chunks
every row of the block fully sees, only past the cache end: the same -inf in the same places.
Values at keys a query cannot see are multiplied by an exact zero, so they must be finite;
padding keys (doc_ids < 0) are zeroed. Every kernel used was also measured to give the same
bits with 1 to 4 threads.

The backward (`attention_backward`) recomputes p per chunk (natural base, through exp2.py) from the
saved log-sum-exp and walks the chunks in the same ascending order: dq accumulates per row over
chunks (row-invariant); dk and dv are sums over query rows (deterministic: fixed shapes, fixed
order).
"""

from __future__ import annotations

import math
import threading

import torch

from titan_audit.batch_invariant.cpu.exp2 import LOG2_E, aligned_numel, exp2, exp2_, exp_via_exp2
from titan_audit.batch_invariant.cpu.matmul import MIN_COLS, bmm, padded_rows
from titan_audit.batch_invariant.cpu.reductions import tree_sum

LN_2 = math.log(2.0)  # scores are kept in base 2 (LOG2_E folded into the scale)
KEY_CHUNK = 128
QUERY_BLOCK = 128
CHUNK_GROUP = 4
GROUP_ELEMENTS = 1 << 20  # score elements per chunk group (small blocks take more chunks)
WORKSPACE_KEEP = 1 << 22  # float32 elements a kept workspace buffer may hold (16 MiB)


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
        self._reach: torch.Tensor | None = None

    def first_row(self, start: int) -> int:
        if not self.causal:
            return 0
        if self._reach is None:  # cummax of the latest position per row
            self._reach = torch.cummax(self.q_positions.amax(dim=0), dim=0).values
        return int(torch.searchsorted(self._reach, start))

    def key_limit(self, r0: int, r1: int) -> int:
        """Keys at or past this are invisible to rows [r0, r1) (causal), or past the cache."""
        if not self.causal or r1 <= r0:
            return self.num_keys
        return min(self.num_keys, int(self.q_positions[:, r0:r1].max()) + 1)

    def visible(self, r0: int, r1: int, start: int, n: int = 1) -> torch.Tensor:
        """bool [B, r1 - r0, n*C]: may query row r0+i see key start+j."""
        width = n * KEY_CHUNK
        keys = torch.arange(start, start + width)
        pos = self.q_positions[:, r0:r1, None]
        vis = (keys < self.num_keys).expand(pos.shape[0], pos.shape[1], width)
        if self.causal:
            vis = vis & (keys <= pos)
        if self.doc_ids is not None:
            stop = min(start + width, self.num_keys)
            docs = torch.full((pos.shape[0], width), -1, dtype=torch.long)
            docs[:, : stop - start] = self.doc_ids[:, start:stop]
            vis = vis & (docs[:, None, :] == self.q_doc[:, r0:r1, None]) & (docs[:, None, :] >= 0)
        return vis

    def visible_heads(self, r0: int, r1: int, start: int, n: int, hkv: int, groups: int) -> torch.Tensor:
        """bool broadcastable to [B, Hkv, G, r1 - r0, n, C] (n chunks from key `start`)."""
        b, rows = self.q_positions.shape[0], r1 - r0
        vis = self.visible(r0, r1, start, n).view(b, 1, 1, rows, n, KEY_CHUNK)
        if self.extra_mask is not None:
            width = n * KEY_CHUNK
            stop = min(start + width, self.num_keys)
            m = self.extra_mask[:, :, r0:r1, start:stop]
            full = torch.zeros((*m.shape[:3], width), dtype=torch.bool)
            full[..., : stop - start] = m
            mb, mh = full.shape[:2]
            full = full.view(mb, hkv if mh != 1 else 1, groups if mh != 1 else 1, rows, n, KEY_CHUNK)
            vis = vis & full
        return vis


def _rows(x: torch.Tensor, r0: int) -> torch.Tensor:
    """[B, Hkv, G, Tq, X] -> [B*Hkv, G*(Tq-r0), X]: the gemm rows of one kv head."""
    b, hkv, g, _, width = x.shape
    return x[:, :, :, r0:].reshape(b * hkv, -1, width)


def _keys(x: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Keys [start, start + count) of [B, H, Tk, D] as [B*H, count, D]: a view when they are all
    in the cache, else a zero-padded copy (so every chunk has its full length C)."""
    b, h, tk, d = x.shape
    stop = min(start + count, tk)
    if stop - start == count:
        return x[:, :, start:stop].reshape(b * h, count, d)
    out = x.new_zeros((b, h, count, d))
    out[:, :, : stop - start] = x[:, :, start:stop]
    return out.reshape(b * h, count, d)


def _apply_mask(s: torch.Tensor, hidden: torch.Tensor) -> None:
    """s = -inf where `hidden` (broadcastable, rows on dim -2) is True, in place, touching only
    the leading rows that have such keys (a row with every key visible is unchanged anyway)."""
    rows = hidden.reshape(-1, *hidden.shape[-2:]).any(dim=-1).any(dim=0)
    if not bool(rows.any()):
        return
    last = int(rows.nonzero().max()) + 1
    s[..., :last, :].masked_fill_(hidden[..., :last, :], float("-inf"))


def _gemm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = a @ b for a [N, R, K] (row-major, R already padded by `padded_rows`), b [N, K, M]:
    straight to MKL when the shape is in the fixed family (M >= MIN_COLS), else through `bmm`
    (which pads columns); either way the bits are those of `matmul.bmm` for these rows."""
    if b.shape[2] >= MIN_COLS and a.stride(2) == 1:
        torch.bmm(a, b, out=out)
    else:
        out.copy_(bmm(a, b))


class _Workspace:
    """Flat float32 buffers by name, grown on demand and reused (contiguous views of a prefix).

    One per thread, kept between calls: fresh multi-MB buffers cost a page fault per 4 KiB on
    first touch (measured: thousands per prefill call). A buffer over `WORKSPACE_KEEP` elements
    is handed out but not kept, so the memory held stays under 4 * WORKSPACE_KEEP bytes a name.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel)
            if numel <= WORKSPACE_KEEP:
                self.buffers[name] = buf
        return buf[:numel]


_THREAD_STATE = threading.local()


def _workspace() -> _Workspace:
    work = getattr(_THREAD_STATE, "work", None)
    if work is None:
        work = _THREAD_STATE.work = _Workspace()
    return work


def _add_gemm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for acc [N, R, M] (contiguous), a [N, R, K] and b [N, K, M] as in `_gemm_into`,
    with the bits of `acc + matmul.bmm(a, b)`: MKL's beta == 1 update adds the finished product
    to acc after the k chain, one rounding per element (measured; tests/batch_invariant/test_attention.py
    checks it), so `baddbmm_` needs no product buffer."""
    if b.shape[2] >= MIN_COLS and a.stride(2) == 1:
        acc.baddbmm_(a, b)
    else:
        acc.add_(bmm(a, b))


def _running_max(m: torch.Tensor, chunk_max: torch.Tensor) -> torch.Tensor:
    """[..., n + 1]: m, then the running maximum of m and chunk_max[..., :c+1] (exact, so order-free).
    For large blocks and few chunks, a few in-place maximums beat `torch.cummax` (a scan that
    also tracks indices); for small blocks (decode) one cummax call is cheaper."""
    n = chunk_max.shape[-1]
    out = torch.cat([m.unsqueeze(-1), chunk_max], dim=-1)
    if n > 8 or out.numel() < 1 << 14:
        return torch.cummax(out, dim=-1).values
    for c in range(1, n + 1):
        torch.maximum(out[..., c], out[..., c - 1], out=out[..., c])
    return out


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
    """(out [B, Hq, Tq, D] float32, lse [B, Hq, Tq] float32; -inf where no key is visible).

    Loop structure (speed only; the arithmetic per row and chunk is the one in the module
    docstring): query rows in blocks of QUERY_BLOCK so a block's scores stay in cache; the
    block's rows of all (batch, kv head) pairs sit in one zero-padded buffer [B*Hkv, R, D]
    (R = `padded_rows`, built once per block); chunks in groups (CHUNK_GROUP, more when the
    block is small, e.g. a decode step, up to a fixed element budget) so that the scores of a
    group come from one gemm and its p @ v from one [R, C] @ [C, D] gemm per chunk; the
    running max of a group's chunks is a cumulative max (exact, so equal to the chunk-by-chunk
    maximum); only the rescale-and-add recurrence walks the chunks one by one, ascending.
    Buffers: the scores live in the thread's workspace (kept between calls), the queries are
    scaled block by block straight into the gemm's row buffer, and acc is that block's rows
    of a zero-initialised [B*Hkv, R, Dv] buffer the gemms add into.
    """
    batch, hq, tq, dim = q.shape
    hkv, tk, dim_v = k.shape[1], k.shape[2], v.shape[3]
    groups, bh = hq // hkv, batch * hkv
    masker = _Masker(q_positions, tk, causal, doc_ids, extra_mask)
    simple_mask = doc_ids is None and extra_mask is None
    q = q.reshape(batch, hkv, groups, tq, dim)  # scaled per block, into the gemm's row buffer
    k, v = k.float(), v.float()
    if doc_ids is not None:  # padding keys may hold anything (NaN); they meet an exact zero p
        v = v.masked_fill((doc_ids < 0)[:, None, :, None], 0.0)
    out = torch.empty((batch, hkv, groups, tq, dim_v))
    lse = torch.empty((batch, hkv, groups, tq))
    full_chunks = tk // KEY_CHUNK
    work = _workspace()  # reused by every block and group, and by later calls on this thread
    q_buf = None
    for r0 in range(0, tq, QUERY_BLOCK):
        r1 = min(r0 + QUERY_BLOCK, tq)
        rows = r1 - r0
        real = groups * rows
        nchunks = _chunks(masker.key_limit(r0, r1))
        r_pad = padded_rows(real, dim, KEY_CHUNK, batched=True)
        if q_buf is None or q_buf.shape[1] != r_pad or real != r_pad:
            q_buf = torch.zeros((bh, r_pad, dim))
        torch.mul(q[:, :, :, r0:r1].float(), scale * LOG2_E, out=q_buf[:, :real].view(batch, hkv, groups, rows, dim))
        m = torch.full((batch, hkv, groups, rows), float("-inf"))
        l = torch.zeros((batch, hkv, groups, rows))  # noqa: E741
        acc_buf = torch.zeros((bh, r_pad, dim_v))  # rows past `real`: padding, never read
        acc = acc_buf[:, :real].view(batch, hkv, groups, rows, dim_v)
        per_group = max(CHUNK_GROUP, GROUP_ELEMENTS // (bh * r_pad * KEY_CHUNK))
        # Causal rows that all see every key below the cache end need no mask but the tail.
        min_pos = int(masker.q_positions[:, r0:r1].min()) if causal and simple_mask else 0
        for c0 in range(0, nchunks, per_group):
            n = min(per_group, nchunks - c0)
            start, width = c0 * KEY_CHUNK, n * KEY_CHUNK
            # One gemm for the group's n*C keys: an output column's bits do not depend on the
            # other columns (tests/batch_invariant/test_matmul.py: column chunks).
            s_flat = work.get("s", aligned_numel(bh * r_pad * width))
            s_buf = s_flat[: bh * r_pad * width].view(bh, r_pad, width)
            inside = max(0, min(n, full_chunks - c0))  # chunks entirely inside the cache
            if inside == n:
                _gemm_into(q_buf, _keys(k, start, width).transpose(1, 2), s_buf)
            else:  # the chunk past the cache end from a zero-padded copy, the rest from a view
                cut = inside * KEY_CHUNK
                if inside:
                    _gemm_into(q_buf, _keys(k, start, cut).transpose(1, 2), s_buf[:, :, :cut])
                _gemm_into(q_buf, _keys(k, start + cut, width - cut).transpose(1, 2), s_buf[:, :, cut:])
            s = s_buf[:, :real].view(batch, hkv, groups, rows, n, KEY_CHUNK)
            # Chunks whose keys below the cache end every row of the block sees need no mask
            # but -inf past the cache end; the rest (the causal diagonal, documents, masks)
            # take the general mask. Either way every hidden score is -inf, every other kept.
            seen = 0
            if simple_mask:
                seen_end = min(tk, min_pos + 1) if causal else tk
                seen = max(0, min(n, (seen_end - start) // KEY_CHUNK))
                if seen == n or (seen_end >= tk and start + width > tk):
                    seen = n
                    if start + width > tk:
                        s_buf[:, :real, tk - start :] = float("-inf")
            if seen < n:
                _apply_mask(s[..., seen:, :], ~masker.visible_heads(r0, r1, start + seen * KEY_CHUNK, n - seen, hkv, groups))
            m_all = _running_max(m, s.amax(dim=-1)).add_(0.0)
            m_safe = torch.where(m_all == float("-inf"), 0.0, m_all)
            alpha = exp2(m_all[..., :-1] - m_safe[..., 1:])  # [B, Hkv, G, rows, n]
            s.sub_(m_safe[..., 1:].unsqueeze(-1))
            exp2_(s_flat)  # whole buffer (padding rows only feed padding outputs): real rows hold p
            p = s
            l_c = tree_sum(p)
            # The recurrence, chunk by chunk in ascending order: one [R, C] @ [C, Dv] gemm per
            # chunk on a strided view of p (row stride n*C; lda does not change bits, see
            # matmul.py), added straight into acc; the chunk past the cache end (if any) takes a
            # zero-padded copy of its values.
            p_chunks = s_buf.view(bh, r_pad, n, KEY_CHUNK)
            for c, (a, l_one) in enumerate(zip(alpha.unbind(-1), l_c.unbind(-1))):
                l.mul_(a).add_(l_one)
                acc.mul_(a.unsqueeze(-1))
                _add_gemm_into(acc_buf, p_chunks[:, :, c], _keys(v, start + c * KEY_CHUNK, KEY_CHUNK))
            m = m_all[..., -1]
        # l >= 1 wherever a key is visible (the row maximum adds 2**0 == 1, exactly: tested, and
        # later chunks scale by exactly 1 or add), else l == 0 and acc == 0: dividing by
        # max(l, 1) is acc / l or an exact zero, and `+ 0.0` makes every zero +0.0.
        out[:, :, :, r0:r1] = acc.div_(l.clamp_min(1.0).unsqueeze(-1)).add_(0.0)
        lse[:, :, :, r0:r1] = torch.where(l > 0, (m + torch.log2(l)) * LN_2, float("-inf"))
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
        s = s.masked_fill(~masker.visible_heads(r0, tq, start, 1, hkv, groups)[..., 0, :], float("-inf"))
        p = exp_via_exp2(s, lse_safe[:, :, :, r0:, None])
        dp = bmm(g_rows, v_c.transpose(1, 2)).view(batch, hkv, groups, rows, KEY_CHUNK)
        ds = (p * (dp - delta[:, :, :, r0:, None])).reshape(batch * hkv, groups * rows, KEY_CHUNK)
        dq[:, :, :, r0:].add_(bmm(ds, k_c).view(batch, hkv, groups, rows, dim))
        p = p.reshape(batch * hkv, groups * rows, KEY_CHUNK)
        dk[:, :, start : start + KEY_CHUNK] = bmm(ds.transpose(1, 2), q_rows).view(batch, hkv, KEY_CHUNK, dim)
        dv[:, :, start : start + KEY_CHUNK] = bmm(p.transpose(1, 2), g_rows).view(batch, hkv, KEY_CHUNK, dim_v)
    dq = (dq * scale + 0.0).reshape(batch, hq, tq, dim)
    return dq, dk[:, :, :tk] + 0.0, dv[:, :, :tk] + 0.0
