"""CPU attention on our own compiled kernels (`kernels/attention.cpp`): a query row's bits depend
only on that row, its position and the keys it can see, on every CPU.

Guarantees (float32 compute for float32/bfloat16/float16 inputs, float64 for float64):
- `attention_forward` gives out[b, h, i] and lse[b, h, i] whose bits depend only on q[b, h, i],
  its position, and the keys/values it can see with their absolute positions: never on the
  batch, Tq, keys it cannot see (present or not, whatever they hold, NaN included), the thread
  count or the ISA variant (scalar, avx2, avx512 give identical bits). So a full prefill, a
  chunked prefill and a token-by-token decode from a KV cache agree bitwise, and a golden
  recorded on one CPU holds on another.
- `attention_backward` is deterministic (fixed order, the same bits for every thread count and
  variant); dq of a row is invariant in the same sense as the forward; dk and dv are sums over
  query rows in a fixed (ascending) order.

The order of operations, by construction (written out next to the code in attention.cpp): keys
in chunks of KEY_CHUNK = 128 aligned to absolute key position, ascending; a score is one fma
chain over head_dim ascending (float32 scores in base 2: q is scaled by scale * log2(e) once);
per chunk an online-softmax update with our own exp2 (ta_math.h); the output accumulates one fma
chain over the visible keys ascending. Invisible keys are skipped, never multiplied by zero.

Visibility of key j for query row (b, h, i) at position pos = q_positions[b, i]: j < Tk; causal:
j <= pos; doc_ids [B, Tk]: doc_ids[b, j] >= 0 and equal to the query's document
doc_ids[b, min(pos, Tk - 1)]; extra_mask (SDPA's attn_mask as bool [B|1, Hq|1, Tq, Tk]): true.
A row that sees no key gets zeros and lse = -inf.

Paged KV cache (`paged_attention`, forward only: decode and prefill from a cache): k_cache,
v_cache [num_blocks, Hkv, block_size, D] (any strides, last dim contiguous), key j of row b at
block block_table[b, j // block_size], slot j % block_size, row b holding seq_lens[b] keys. The
kernel is the forward above with only the addresses its keys and values are read from changed
(a pointer per key of a chunk instead of a stride), so a row's bits equal the dense forward's on
the same keys at the same positions, by construction: no dense copy of the cache is made.

Dispatch: eager calls go straight to the kernel through ctypes; under torch.compile the same
kernel runs as the custom ops `titan_audit::attention_fwd` / `titan_audit::attention_bwd`
(register_fake gives their shapes), so compiled graphs keep these bits.
"""

from __future__ import annotations

import ctypes

import torch

from titan_audit.batch_invariant.cpu import _lib

KEY_CHUNK = 128  # kernels/attention.cpp KC: keys per chunk, aligned to absolute key positions
LOG2_E = 1.4426950408889634

_P, _I = ctypes.c_void_p, ctypes.c_int
for _t, _f in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
    _lib.declare(f"attention_fwd_{_t}", None, [_P, _P, _P, _P, _P, _P, _P, _f, _P, _P, _I])
    _lib.declare(f"attention_bwd_{_t}", None, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _f, _f, _P, _P, _P, _I])
    _lib.declare(f"attention_paged_fwd_{_t}", ctypes.c_int, [_P, _P, _P, _P, _P, _P, _P, _f, _P, _P, _I])
_PROBLEM = ctypes.c_int64 * 21
_PAGED_PROBLEM = ctypes.c_int64 * 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the compute dtype with a contiguous last dim (other strides are passed as they are)."""
    x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


class _Call:
    """The kernel arguments shared by forward and backward: operands, problem vector, masks."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        q_positions: torch.Tensor,
        doc_ids: torch.Tensor | None,
        extra_mask: torch.Tensor | None,
    ) -> None:
        self.dtype = _compute_dtype(q.dtype)
        self.q, self.k, self.v = (_operand(x, self.dtype) for x in (q, k, v))
        batch, hq, tq, dim = q.shape
        hkv, tk, dim_v = k.shape[1], k.shape[2], v.shape[3]
        assert hq % hkv == 0 and k.shape[0] == v.shape[0] == batch and k.shape[3] == dim and v.shape[2] == tk
        self.shape = (batch, hq, hkv, tq, tk, dim, dim_v)
        self.positions = q_positions.to(torch.int64).expand(batch, tq).contiguous()
        self.doc = None if doc_ids is None else doc_ids.to(torch.int64).contiguous()
        mask_strides = [0, 0, 0, 0]
        self.mask = None
        if extra_mask is not None:
            mask = extra_mask  # bool "may attend" (mode._sdpa_mask converts additive 0/-inf masks)
            assert (
                mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[2:] == (tq, tk)
                and mask.shape[0] in (1, batch)
            ), mask.shape
            assert mask.shape[1] in (1, hq), mask.shape
            self.mask = mask
            mask_strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in range(4)]
        strides = [s for x in (self.q, self.k, self.v) for s in x.stride()[:3]]
        self.problem = _PROBLEM(*self.shape, int(bool(causal)), *strides, *mask_strides)
        self.suffix = "f64" if self.dtype == torch.float64 else "f32"

    @staticmethod
    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()


def _forward_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    extra_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    call = _Call(q, k, v, causal, q_positions, doc_ids, extra_mask)
    batch, hq, _, tq, _, _, dim_v = call.shape
    out = _lib.output((batch, hq, tq, dim_v), call.dtype)
    lse = _lib.output((batch, hq, tq), call.dtype)
    if out.numel() == 0:
        return out, lse
    score_scale = scale * LOG2_E if call.dtype == torch.float32 else scale  # float32 scores are base 2
    p = call.ptr
    _lib.kernel(f"attention_fwd_{call.suffix}")(
        call.problem,
        p(call.q),
        p(call.k),
        p(call.v),
        p(call.positions),
        p(call.doc),
        p(call.mask),
        score_scale,
        p(out),
        p(lse),
        _lib.num_threads(),
    )
    return out, lse


def _backward_eager(
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
    extra_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _Call(q, k, v, causal, q_positions, doc_ids, extra_mask)
    batch, hq, hkv, tq, tk, dim, dim_v = call.shape
    dq = _lib.output((batch, hq, tq, dim), call.dtype)
    dk = _lib.output((batch, hkv, tk, dim), call.dtype)
    dv = _lib.output((batch, hkv, tk, dim_v), call.dtype)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    g = grad_out.to(call.dtype).contiguous()
    o = out.to(call.dtype).contiguous()
    lse_c = lse.to(call.dtype).contiguous()
    score_scale = scale * LOG2_E if call.dtype == torch.float32 else scale
    p = call.ptr
    _lib.kernel(f"attention_bwd_{call.suffix}")(
        call.problem,
        p(call.q),
        p(call.k),
        p(call.v),
        p(g),
        p(o),
        p(lse_c),
        p(call.positions),
        p(call.doc),
        p(call.mask),
        score_scale,
        scale,
        p(dq),
        p(dk),
        p(dv),
        _lib.num_threads(),
    )
    return dq, dk, dv


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
    max_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Hq, Tq, D], lse [B, Hq, Tq]) in the compute dtype over a paged KV cache, with the
    bits of `attention_forward` over the same keys gathered densely (see the module doc).

    q [B, Hq, Tq, D]; k_cache, v_cache [num_blocks, Hkv, block_size, D] of q's dtype (strided
    views of a cache are read in place; a float32/float64 cache is never copied, a
    bfloat16/float16 one has the blocks its table names converted); block_table [B, n] int;
    seq_lens [B] int (keys present per row, at most n * block_size); q_positions [B, Tq] (or
    broadcastable) long; max_seq_len: an upper bound of seq_lens (checked). The same call as the
    Triton backend's `paged_attention`. Forward only: a call that autograd would record raises.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError(
            "paged_attention is forward-only (decode, prefill from a cache); gather the keys and use "
            "attention_forward / batch_invariant.attention where a gradient is needed, or call it under torch.no_grad()"
        )
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: expected q [B, Hq, Tq, D] and k_cache, v_cache [blocks, Hkv, block_size, D], got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"paged_attention: q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}")
    batch, hq, tq, dim = q.shape
    num_blocks, hkv, block_size, _ = k_cache.shape
    if k_cache.shape[3] != dim or hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"paged_attention: q {tuple(q.shape)} does not fit a cache of {hkv} kv heads of head_dim {k_cache.shape[3]}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != batch or tuple(seq_lens.shape) != (batch,):
        raise ValueError(
            f"paged_attention: expected block_table [{batch}, n] and seq_lens [{batch}], got "
            f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
    dtype = _compute_dtype(q.dtype)
    table = block_table.to(torch.int64).contiguous()
    if k_cache.dtype != dtype:  # only the blocks in the table, converted (the values, exactly)
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_blocks):
            raise ValueError(f"paged_attention: block_table entries must lie in [0, {num_blocks})")
        used, table = torch.unique(table, return_inverse=True)
        k_cache, v_cache = (c.index_select(0, used) for c in (k_cache, v_cache))
        num_blocks = used.numel()
    q, k_cache, v_cache = (_operand(x, dtype) for x in (q, k_cache, v_cache))
    width = table.shape[1]
    tk = width * block_size if max_seq_len is None else int(max_seq_len)
    positions = q_positions.to(torch.int64).expand(batch, tq).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = _lib.output((batch, hq, tq, dim), dtype)
    lse = _lib.output((batch, hq, tq), dtype)
    if out.numel() == 0:
        return out, lse
    strides = [s for x in (q, k_cache, v_cache) for s in x.stride()[:3]]
    problem = _PAGED_PROBLEM(batch, hq, hkv, tq, tk, dim, dim, int(bool(causal)), *strides, 0, 0, 0, 0)
    problem[21], problem[22], problem[23] = width, block_size, num_blocks
    score_scale = scale * LOG2_E if dtype == torch.float32 else scale  # float32 scores are base 2
    suffix = "f64" if dtype == torch.float64 else "f32"
    p = _Call.ptr
    rc = _lib.kernel(f"attention_paged_fwd_{suffix}")(
        problem,
        p(q),
        p(k_cache),
        p(v_cache),
        p(positions),
        p(table),
        p(lens),
        score_scale,
        p(out),
        p(lse),
        _lib.num_threads(),
    )
    if rc == 1:
        raise ValueError(
            f"paged_attention: seq_lens {lens.tolist()} must lie in [0, min(max_seq_len {tk}, "
            f"table width {width} * block_size {block_size})]"
        )
    if rc == 2:
        raise ValueError(f"paged_attention: a block_table entry of a present key lies outside [0, {num_blocks})")
    assert rc == 0, rc
    return out, lse


@torch.library.custom_op("titan_audit::attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    q_positions: torch.Tensor,
    doc_ids: torch.Tensor | None,
    extra_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_eager(q, k, v, scale, causal, q_positions, doc_ids, extra_mask)


@_fwd_op.register_fake
def _(q, k, v, scale, causal, q_positions, doc_ids, extra_mask):  # noqa: ANN001, ANN202
    dtype = _compute_dtype(q.dtype)
    return (
        q.new_empty((*q.shape[:3], v.shape[3]), dtype=dtype),
        q.new_empty(tuple(q.shape[:3]), dtype=dtype),
    )


@torch.library.custom_op("titan_audit::attention_bwd", mutates_args=())
def _bwd_op(
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
    extra_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_eager(grad_out, q, k, v, out, lse, scale, causal, q_positions, doc_ids, extra_mask)


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, scale, causal, q_positions, doc_ids, extra_mask):  # noqa: ANN001, ANN202
    dtype = _compute_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype), v.new_empty(v.shape, dtype=dtype)


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
    """(out [B, Hq, Tq, Dv], lse [B, Hq, Tq]) in the compute dtype; zeros / -inf where no key is visible.

    q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv], Hq % Hkv == 0 (head h reads kv head
    h // (Hq // Hkv)); q_positions [B, Tq] (or broadcastable) long; visibility in the module doc.
    """
    if torch.compiler.is_compiling():
        return torch.ops.titan_audit.attention_fwd(q, k, v, scale, causal, q_positions, doc_ids, extra_mask)
    return _forward_eager(q, k, v, scale, causal, q_positions, doc_ids, extra_mask)


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
    """(dq, dk, dv) in the compute dtype, from the forward's out and lse (p recomputed per chunk)."""
    if torch.compiler.is_compiling():
        return torch.ops.titan_audit.attention_bwd(
            grad_out, q, k, v, out, lse, scale, causal, q_positions, doc_ids, extra_mask
        )
    return _backward_eager(grad_out, q, k, v, out, lse, scale, causal, q_positions, doc_ids, extra_mask)
