"""Dropless top-k mixture of experts (Qwen3-MoE routing), optionally with a gated shared expert.

Routing: router logits = gate(x) (model dtype), probabilities = softmax in float32, the top k
experts by probability with ties broken by the lower expert index (a stable descending sort,
not `torch.topk`, whose tie order is unspecified), optionally renormalised to sum to 1
(`norm_topk_prob`).

Guarantees:
- Dropless: no capacity factor, every token is processed by all k of its experts, so a token's
  output never depends on other tokens' routing.
- Batch invariance (BI mode): tokens are grouped by expert for the expert matmuls; a BI matmul
  gives a row the same bits whatever the number of rows, so grouping does not change a token's
  bits. The k expert outputs are scaled and summed per token in a fixed order (rank 0, 1, ...,
  k-1), independent of the other tokens. With the shared expert:
  out += sigmoid(shared_expert_gate(x)) * shared_expert(x) (the Qwen2-MoE form).

Weights: `experts.gate_proj`/`up_proj` [E, I, H] and `experts.down_proj` [E, H, I]; `hf.py`
converts to and from the per-expert HF names (`mlp.experts.{e}.gate_proj.weight`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_audit.models import ops
from titan_audit.models.mlp import FeedForward


def route(probs_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest probabilities per row and their expert ids; ties go to the lower id."""
    values_NE, experts_NE = torch.sort(probs_NE, dim=-1, descending=True, stable=True)
    return values_NE[:, :k], experts_NE[:, :k]


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights; tokens are processed grouped by expert."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    @torch.compiler.disable  # data-dependent group sizes: runs eagerly inside compiled blocks
    def forward(self, x_ND: torch.Tensor, experts_NK: torch.Tensor) -> torch.Tensor:
        """Expert outputs [N, K, D]: out[n, j] = expert experts_NK[n, j] applied to x_ND[n]."""
        num_tokens, k = experts_NK.shape
        flat_experts = experts_NK.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        x_sorted = x_ND[order // k]
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            x_e = x_sorted[start : start + count]
            hidden = ops.silu(ops.linear(x_e, self.gate_proj[expert]))
            hidden = hidden * ops.linear(x_e, self.up_proj[expert])
            outputs.append(ops.linear(hidden, self.down_proj[expert]))
            start += count
        assert start == num_tokens * k
        out_sorted = torch.cat(outputs) if outputs else x_ND.new_zeros(0, x_ND.shape[-1])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out_sorted[inverse].reshape(num_tokens, k, -1)


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        hidden_dim: int,
        norm_topk_prob: bool,
        shared_hidden_dim: int = 0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)
        if shared_hidden_dim:
            self.shared_expert = FeedForward(dim, shared_hidden_dim)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        router_logits_NE = ops.linear(x_ND, self.gate.weight)
        probs_NE = ops.softmax(router_logits_NE.float(), -1)
        top_probs_NK, top_experts_NK = route(probs_NE, self.top_k)
        if self.norm_topk_prob:
            top_probs_NK = top_probs_NK / ops.sum_last(top_probs_NK, keepdim=True)
        weights_NK = top_probs_NK.to(x_ND.dtype)
        expert_out_NKD = self.experts(x_ND, top_experts_NK)
        out_ND = expert_out_NKD[:, 0] * weights_NK[:, 0:1]
        for rank in range(1, self.top_k):
            out_ND = out_ND + expert_out_NKD[:, rank] * weights_NK[:, rank : rank + 1]
        if self.shared_expert is not None:
            shared_gate_N1 = ops.sigmoid(ops.linear(x_ND, self.shared_expert_gate.weight))
            out_ND = out_ND + shared_gate_N1 * self.shared_expert(x_ND)
        return out_ND.reshape(x_BTD.shape)
