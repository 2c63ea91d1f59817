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

Load-balancing statistics (`forward(x, token_mask, return_stats=True)`): per expert e, the sum
over the (unmasked) tokens of the router probability P[n, e] (float32, differentiable) and the
number of top-k slots routed to e (float32, exact integers, no gradient). `load_balancing_loss`
turns the statistics of the MoE layers into the Switch/Qwen3-MoE auxiliary loss
E * sum_e f_e * P_e, where f_e = (top-k assignments to e) / R and P_e = (sum of P[., e]) / R over
the R = (MoE layers x tokens) rows: the value of HF's `load_balancing_loss_func` (rows pooled over
layers, padding tokens excluded). Both sums run over the tokens of the one forward call only, in
a fixed order for a fixed shape, so the loss of a microbatch depends on that microbatch alone
(never on the other microbatches, the world size or the rank). They are reductions over tokens,
so they are NOT batch invariant (G2 concerns per-token results; this is a per-batch quantity).

Weights: `experts.gate_proj`/`up_proj` [E, I, H] and `experts.down_proj` [E, H, I]; `hf.py`
converts to and from the per-expert HF names (`mlp.experts.{e}.gate_proj.weight`, ...). The
statistics add no parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_audit.models import ops
from titan_audit.models.mlp import FeedForward

RouterStats = tuple[torch.Tensor, torch.Tensor]  # (probability sum [E] fp32, assignment count [E] fp32)


def router_stats(probs_NE: torch.Tensor, experts_NK: torch.Tensor, token_mask_N: torch.Tensor | None) -> RouterStats:
    """Per-expert sum of router probabilities and count of top-k assignments over the unmasked
    tokens. The count is computed in int64 (exact) and returned as float32."""
    num_experts = probs_NE.shape[-1]
    assigned_NE = F.one_hot(experts_NK, num_experts).sum(1)  # int64, 0..k per entry
    if token_mask_N is not None:
        mask_N = token_mask_N.reshape(-1)
        probs_NE = probs_NE * mask_N.to(probs_NE.dtype)[:, None]
        assigned_NE = assigned_NE * mask_N.to(assigned_NE.dtype)[:, None]
    return probs_NE.sum(0), assigned_NE.sum(0).to(torch.float32)


def load_balancing_loss(stats: list[RouterStats], num_tokens: int, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over the rows of every MoE layer's stats (see the module doc).

    stats: one (prob_sum, count) per MoE layer, summed in list order (layer order); num_tokens:
    the unmasked tokens of the forward call. 0 (float32) without MoE layers or tokens."""
    rows = len(stats) * num_tokens
    if rows == 0:
        return torch.zeros((), dtype=torch.float32)
    prob_sum_E, count_E = stats[0]
    for p, c in stats[1:]:
        prob_sum_E, count_E = prob_sum_E + p, count_E + c
    return num_experts * ((count_E / rows) * (prob_sum_E / rows)).sum()


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
        # x_ND[order // k], written so that its backward is exact: `order` is a permutation
        # (distinct destinations) and the expand's backward sums each token's k copies by the
        # fixed-order sum (BI mode) instead of an index_put_ accumulating in ATen's order.
        x_sorted = x_ND[:, None, :].expand(-1, k, -1).reshape(num_tokens * k, -1)[order]
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

    def forward(
        self, x_BTD: torch.Tensor, token_mask: torch.Tensor | None = None, return_stats: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        """The MoE output [B, T, D]; with `return_stats`, also the layer's RouterStats over the
        tokens where `token_mask` [B, T] (bool) is True (all tokens if None)."""
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
        out_BTD = out_ND.reshape(x_BTD.shape)
        if return_stats:
            return out_BTD, router_stats(probs_NE, top_experts_NK, token_mask)
        return out_BTD
