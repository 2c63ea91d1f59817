"""Grouped-query self-attention with RoPE and optional q/k-norm (Qwen3; Llama without norms).

One forward for every use; the caller picks where keys come from:
- `cache_step` (prefill / decode): new k/v are written to the KV cache and attention runs over
  the row's cached keys, the queries at their absolute positions `cache_step.q_pos_BT` (a paged
  cache's keys through its block table: `ops.paged_attention`);
- `packing` (packed training rows): per-document attention, see `packing.py`;
- neither: plain causal attention over the T tokens at positions 0..T-1.

RoPE rotates q and k with the caller's cos/sin (so RoPE positions and cache slots are separate
notions: packed documents restart RoPE at 0). Every op is per token except the attention
reduction, which goes through `ops.attention` (BI attention in batch-invariant mode).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_audit.models import ops
from titan_audit.models.kv_cache import PagedKeys
from titan_audit.models.norm import RMSNorm
from titan_audit.models.packing import PackedLayout
from titan_audit.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        layer: int,
        cache_step: object | None = None,
        packing: PackedLayout | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x_BTD.shape
        # -1 heads: under tensor parallelism this rank's heads (its q/k/v columns), else all
        q_BTHd = ops.linear(x_BTD, self.q_proj.weight).view(batch, seq, -1, self.head_dim)
        k_BTHd = ops.linear(x_BTD, self.k_proj.weight).view(batch, seq, -1, self.head_dim)
        v_BTHd = ops.linear(x_BTD, self.v_proj.weight).view(batch, seq, -1, self.head_dim)
        weight = self.q_proj.weight  # a DTensor under tensor parallelism: q/k hold this rank's heads
        if self.q_norm is not None and not isinstance(weight, DTensor):  # norm + RoPE (fused in BI inference)
            q_BHTd = ops.rms_norm_rope(q_BTHd, self.q_norm.weight, cos_BTd, sin_BTd, self.q_norm.eps)
            k_BHTd = ops.rms_norm_rope(k_BTHd, self.k_norm.weight, cos_BTd, sin_BTd, self.k_norm.eps)
        else:
            if self.q_norm is not None:
                tp_group = weight.device_mesh.get_group()
                q_BTHd = self.q_norm(q_BTHd, tp_group)
                k_BTHd = self.k_norm(k_BTHd, tp_group)
            q_BHTd = apply_rope(q_BTHd.transpose(1, 2), cos_BTd, sin_BTd)
            k_BHTd = apply_rope(k_BTHd.transpose(1, 2), cos_BTd, sin_BTd)
        v_BHTd = v_BTHd.transpose(1, 2)

        if cache_step is not None:
            keys = cache_step.update(layer, k_BHTd, v_BHTd)
            if isinstance(keys, PagedKeys):
                out_BHTd = ops.paged_attention(q_BHTd, keys, cache_step.q_pos_BT)
            else:
                out_BHTd = ops.attention(q_BHTd, *keys, cache_step.q_pos_BT)
            out_BTHd = out_BHTd.transpose(1, 2)
        elif packing is not None:
            out_BTHd = packing.attention(q_BHTd.transpose(1, 2), k_BHTd.transpose(1, 2), v_BHTd.transpose(1, 2))
        else:
            q_pos_BT = torch.arange(seq, device=x_BTD.device).expand(batch, seq)
            out_BTHd = ops.attention(q_BHTd, k_BHTd, v_BHTd, q_pos_BT).transpose(1, 2)
        out_BTF = out_BTHd.reshape(batch, seq, -1)
        return ops.linear(out_BTF, self.o_proj.weight)
