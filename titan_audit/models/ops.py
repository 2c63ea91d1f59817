"""The numerics the model runs on: batch-invariant ops in BI mode, native torch ops otherwise.

Every matmul, norm, softmax, reduction, activation and attention call of models/ goes through
this file, so there is one switch point. In batch-invariant mode
(`titan_audit.batch_invariant.is_enabled()`) each function calls the batch-invariant version
(`titan_audit.batch_invariant.linear`, `rms_norm`, `softmax`, `log_softmax`, `sum`, `attention`)
and the position-independent pointwise functions of `pointwise.py`; outside it, the native torch
kernels (`F.linear`, `F.rms_norm`, SDPA, ...). The two paths compute the same mathematics.

Guarantee in BI mode: a row's result depends only on that row's inputs (and, for attention, on
its visible keys/values and their positions), never on the batch size or on other rows. Outside
BI mode nothing beyond torch's own behaviour is promised.

Attention semantics (both modes; `paged_attention` the same over a paged cache's keys): queries
`q_BHTD` sit at absolute positions `q_pos`; key `j` sits at absolute position `j`; key `j` is
visible to a query at position `p` iff `j <= p` and, with `key_doc_ids`,
`key_doc_ids[b, j] == key_doc_ids[b, p] >= 0`. A query with no visible key (a padding position)
outputs zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_audit import batch_invariant
from titan_audit.models import pointwise, tensor_parallel
from titan_audit.models.kv_cache import PagedKeys
from titan_audit.models.rope import apply_rope


def bi_mode() -> bool:
    """True while batch-invariant mode is on (the model then uses the batch-invariant ops)."""
    return batch_invariant.is_enabled()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, gather_output: bool = False
) -> torch.Tensor:
    """x @ weight.T (+ bias). A tensor-parallel weight (a DTensor sharded column- or row-wise)
    runs through `tensor_parallel.linear` (its bits are the unsharded linear's; `gather_output`:
    a column-wise result gathered to the full width, the LM head's)."""
    if isinstance(weight, DTensor):
        assert bias is None, "tensor-parallel linears have no bias"
        return tensor_parallel.linear(x, weight, gather_output=gather_output)
    if bi_mode():
        return batch_invariant.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tp_group=None) -> torch.Tensor:  # noqa: ANN001
    """HF-style RMSNorm: normalise in float32, cast back to x's dtype, then scale by `weight`.
    `tp_group`: x [B, T, H/t, d] holds this tensor-parallel rank's heads of a per-head norm
    (q/k-norm), so the weight's gradient, a sum over every head, is taken over all ranks' heads
    (`tensor_parallel.scale_heads`)."""
    if tp_group is None and _fused_scaled_norm(x, weight):
        return batch_invariant.scaled_rms_norm(x, weight, eps)  # the bits of the lines below
    x32 = x.float()
    if bi_mode():
        normed = batch_invariant.rms_norm(x32, None, eps)
    else:
        normed = F.rms_norm(x32, (x.shape[-1],), None, eps)
    if tp_group is not None:
        return tensor_parallel.scale_heads(weight, normed.to(x.dtype), tp_group)
    return weight * normed.to(x.dtype)


def _fused_scaled_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `batch_invariant.scaled_rms_norm` may replace rms_norm's norm-then-multiply: BI
    mode, eager, x and a [N] weight both float32 (the norm runs in float32 whatever x's dtype, so
    only then does no cast sit between the two ops), plain tensors."""
    return (
        bi_mode()
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 1
        and not torch.compiler.is_compiling()
        and not isinstance(x, DTensor)
        and not isinstance(weight, DTensor)
    )


def _fused_inference(*tensors: torch.Tensor) -> bool:
    """Whether a fused inference op may replace its composition here: BI mode, float32, plain
    tensors, no autograd recording, eager (the fused ops are forward-only kernels)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and _fusable(*tensors)


def _fusable(*tensors: torch.Tensor) -> bool:
    """BI mode, eager, float32 plain tensors: where a fused op with a backward may serve training."""
    return (
        bi_mode()
        and not torch.compiler.is_compiling()
        and all(t.dtype == torch.float32 and not isinstance(t, DTensor) for t in tensors)
    )


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight, eps)): a residual add and the norm after it. For
    float32 inference in BI mode one fused kernel (`batch_invariant.add_rms_norm`: the same bits
    for every non-NaN element); otherwise these two ops, as written."""
    if _fused_inference(h, delta, weight) and h.shape == delta.shape:
        return batch_invariant.add_rms_norm(h, delta, weight, eps)
    s = h + delta
    return s, rms_norm(s, weight, eps)


def rms_norm_rope(
    x_BTHd: torch.Tensor, weight: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor, eps: float
) -> torch.Tensor:
    """q/k-norm then RoPE: `apply_rope(rms_norm(x, weight, eps).transpose(1, 2), cos, sin)`, [B, H, T, d]
    (weight [d] or [H, d]). For float32 inference in BI mode one fused kernel
    (`batch_invariant.rms_norm_rope`: the same bits for every non-NaN element; the result is a
    transposed view); otherwise these ops, as written."""
    if _fused_inference(x_BTHd, weight, cos_BTd, sin_BTd) and x_BTHd.shape[-1] % 2 == 0:
        batch, seq, heads, d = x_BTHd.shape
        cos_Nd, sin_Nd = (t.expand(batch, seq, d).reshape(-1, d) for t in (cos_BTd, sin_BTd))
        y_NHd = batch_invariant.rms_norm_rope(x_BTHd.reshape(-1, heads, d), weight, cos_Nd, sin_Nd, eps)
        return y_NHd.view(batch, seq, heads, d).transpose(1, 2)
    return apply_rope(rms_norm(x_BTHd, weight, eps).transpose(1, 2), cos_BTd, sin_BTd)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU). For float32 in BI mode one fused kernel (`batch_invariant.silu_mul`:
    the same bits for every non-NaN element, forward and, where the backend has it, backward);
    otherwise the two ops."""
    if gate.shape == up.shape and _fusable(gate, up):
        training = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
        if not training or hasattr(batch_invariant.backend_for(gate, up), "silu_mul_backward"):
            return batch_invariant.silu_mul(gate, up)
    return silu(gate) * up


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise.silu(x) if bi_mode() else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise.sigmoid(x) if bi_mode() else torch.sigmoid(x)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return batch_invariant.softmax(x, dim) if bi_mode() else torch.softmax(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return batch_invariant.log_softmax(x, dim) if bi_mode() else torch.log_softmax(x, dim)


def sum_last(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dimension."""
    if bi_mode():
        return batch_invariant.sum(x, -1, keepdim=keepdim)
    return x.sum(-1, keepdim=keepdim)


def paged_attention(q_BHTD: torch.Tensor, keys: PagedKeys, q_pos_BT: torch.Tensor) -> torch.Tensor:
    """`attention` over one layer's keys in a paged KV cache (`kv_cache.PagedKeys`): the same result.

    In BI mode outside autograd, on plain tensors, the backend's paged kernel reads the keys
    through the block table in place (CPU and Triton kernels alike change only addresses, never
    the order: the bits are `attention`'s over the gathered keys). Otherwise (native mode, a
    gradient to record, tensor-parallel DTensors) the keys are gathered (`keys.gather()`) and
    `attention` runs on them, as a dense cache's would.
    """
    plain = not any(isinstance(t, DTensor) for t in (q_BHTD, keys.k_NHSD, keys.v_NHSD))
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHTD, keys.k_NHSD, keys.v_NHSD))
    if bi_mode() and plain and not recording:
        return _bi_paged_attention(q_BHTD, keys, q_pos_BT)
    return attention(q_BHTD, *keys.gather(), q_pos_BT)


@torch.compiler.disable
def _bi_paged_attention(q_BHTD: torch.Tensor, keys: PagedKeys, q_pos_BT: torch.Tensor) -> torch.Tensor:
    # Opaque to torch.compile, as _bi_attention: a forward-only kernel reading a cache in place.
    backend = batch_invariant.backend_for(q_BHTD, keys.k_NHSD, keys.v_NHSD)
    out, _ = backend.paged_attention(
        q_BHTD,
        keys.k_NHSD,
        keys.v_NHSD,
        keys.table_BN,
        keys.seq_lens_B,
        q_pos_BT,
        q_BHTD.shape[-1] ** -0.5,
        causal=True,
        max_seq_len=keys.max_seq_len,
    )
    return out.to(q_BHTD.dtype)


@torch.compiler.disable
def _bi_attention(q_BHTD, k_BHTD, v_BHTD, q_pos_BT, key_doc_ids_BS):
    # Opaque to torch.compile: a kernel with data-dependent control flow; compiling around it
    # keeps its bits and avoids tracing (and re-tracing per shape) into it.
    return batch_invariant.attention(q_BHTD, k_BHTD, v_BHTD, causal=True, q_positions=q_pos_BT, doc_ids=key_doc_ids_BS)


def attention(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    q_pos_BT: torch.Tensor,
    key_doc_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention with absolute query positions; see the module doc.

    q [B, Hq, T, D], k/v [B, Hkv, S, D] (Hq a multiple of Hkv), q_pos_BT [B, T] long,
    key_doc_ids_BS [B, S] long or None. Returns [B, Hq, T, D] in q's dtype.
    """
    batch, _, seq_q, _ = q_BHTD.shape
    seq_k = k_BHTD.shape[2]
    assert q_pos_BT.shape == (batch, seq_q), (q_pos_BT.shape, q_BHTD.shape)
    assert key_doc_ids_BS is None or key_doc_ids_BS.shape == (batch, seq_k)
    if bi_mode():
        out = _bi_attention(q_BHTD, k_BHTD, v_BHTD, q_pos_BT, key_doc_ids_BS)
    else:
        key_pos_S = torch.arange(seq_k, device=q_BHTD.device)
        visible_BTS = key_pos_S[None, None, :] <= q_pos_BT[:, :, None]
        if key_doc_ids_BS is not None:
            query_doc_BT = key_doc_ids_BS.gather(1, q_pos_BT)
            same_doc_BTS = key_doc_ids_BS[:, None, :] == query_doc_BT[:, :, None]
            visible_BTS = visible_BTS & same_doc_BTS & (key_doc_ids_BS[:, None, :] >= 0)
            # A padding query sees itself here (its output is zeroed below): no fully masked
            # row, so no NaN that some SDPA kernels would otherwise put into gradients.
            visible_BTS = visible_BTS | (key_pos_S[None, None, :] == q_pos_BT[:, :, None])
        out = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=visible_BTS[:, None], enable_gqa=True)
    if key_doc_ids_BS is not None:
        # A padding query sees no key; its output is defined as zeros in both modes.
        query_is_real_BT = key_doc_ids_BS.gather(1, q_pos_BT) >= 0
        out = torch.where(query_is_real_BT[:, None, :, None], out, torch.zeros((), dtype=out.dtype))
    return out
