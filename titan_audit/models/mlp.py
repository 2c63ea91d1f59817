"""SwiGLU feed-forward (HF layout: gate_proj, up_proj, down_proj, no biases).

down(silu(gate(x)) * up(x)); every op acts on one token's row, through `ops`, so in
batch-invariant mode a token's output depends on that token alone (`ops.silu_mul`: one fused
kernel for BI inference, the same bits).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_audit.models import ops


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = ops.linear(x, self.gate_proj.weight), ops.linear(x, self.up_proj.weight)
        return ops.linear(ops.silu_mul(gate, up), self.down_proj.weight)
