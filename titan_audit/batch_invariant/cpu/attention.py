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
_PROBLEM = ctypes.c_int64 * 21


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
