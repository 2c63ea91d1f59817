"""Packed documents: per-document causal attention inside one packed row, via segments.

`doc_ids` [B, T] gives each token a document id; a document is a maximal run of equal ids in a
row; ids < 0 are padding. `PackedLayout(doc_ids)` cuts the rows into G documents ("segments"),
and attention runs on a [G, L, ...] batch of documents, each starting at position 0
(L = the longest document). RoPE positions default to the index inside the document.

Guarantee: in batch-invariant mode a document's attention call is the same computation as for
the document alone (the BI attention contract makes a row's bits independent of the batch size,
the padded length and invisible keys), and every other op of the model is per token; so a
document's logits are bitwise those of running it alone. Padding tokens get zero attention
output (their logits are finite but meaningless).
"""

from __future__ import annotations

import torch

from titan_audit.models import ops

# A 0-dim tensor: `grad + _ZERO` is `grad + 0.0` in grad's dtype, bit for bit, without a Python
# number (which the BI add route would first turn into a tensor).
_ZERO = torch.zeros(())


class _GatherDistinct(torch.autograd.Function):
    """x[indices] for indices that name distinct elements. The backward puts each gradient row in
    its one place (`index_put_` without accumulate: exact, and cheap for the BI op census) where
    autograd's own would accumulate into zeros; `grad + 0` keeps its bits (0 + g: -0.0 -> +0.0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(*indices)
        ctx.shape = x.shape
        return x[indices]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        indices = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape)
        out[indices] = grad + _ZERO
        return (out, *(None for _ in indices))


def _gather_distinct(x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
    return _GatherDistinct.apply(x, *indices) if torch.is_grad_enabled() and x.requires_grad else x[indices]


class PackedLayout:
    def __init__(self, doc_ids_BT: torch.Tensor) -> None:
        batch, seq = doc_ids_BT.shape
        device = doc_ids_BT.device
        valid_BT = doc_ids_BT >= 0
        changes_BT = torch.ones_like(valid_BT)
        changes_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
        starts_N = (valid_BT & changes_BT).reshape(-1)
        self.shape = (batch, seq)
        self.valid_N = valid_BT.reshape(-1)
        self.token_idx = self.valid_N.nonzero().squeeze(1)  # flat index of every real token
        segment_N = torch.cumsum(starts_N.long(), 0) - 1
        start_flat_G = starts_N.nonzero().squeeze(1)
        self.num_segments = int(start_flat_G.numel())
        self.segment = segment_N[self.token_idx]
        self.offset = self.token_idx - start_flat_G[self.segment]
        lengths_G = torch.bincount(self.segment, minlength=self.num_segments)
        self.max_len = int(lengths_G.max()) if self.num_segments else 0
        arange_L = torch.arange(self.max_len, device=device)
        self.key_doc_ids_GL = torch.where(arange_L[None, :] < lengths_G[:, None], 0, -1)
        self.q_pos_GL = arange_L[None, :].expand(self.num_segments, self.max_len)
        rope_N = torch.zeros(batch * seq, dtype=torch.long, device=device)
        rope_N[self.token_idx] = self.offset
        self.rope_positions_BT = rope_N.view(batch, seq)

    def to_segments(self, x_BTHD: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [G, L, H, D] (zeros past each document's end)."""
        flat = x_BTHD.reshape(-1, *x_BTHD.shape[2:])
        out = flat.new_zeros(self.num_segments, self.max_len, *x_BTHD.shape[2:])
        out[self.segment, self.offset] = _gather_distinct(flat, self.token_idx)
        return out

    def from_segments(self, x_GLHD: torch.Tensor) -> torch.Tensor:
        """[G, L, H, D] -> [B, T, H, D] (zeros at padding tokens)."""
        batch, seq = self.shape
        out = x_GLHD.new_zeros(batch * seq, *x_GLHD.shape[2:])
        out[self.token_idx] = _gather_distinct(x_GLHD, self.segment, self.offset)
        return out.view(batch, seq, *x_GLHD.shape[2:])

    def attention(self, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        """Per-document causal attention; [B, T, H, D] layout in and out."""
        if self.num_segments == 0:
            return torch.zeros_like(q_BTHD)
        q, k, v = (self.to_segments(t).transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHD))
        out_GHLD = ops.attention(q, k, v, self.q_pos_GL, self.key_doc_ids_GL)
        return self.from_segments(out_GHLD.transpose(1, 2))
