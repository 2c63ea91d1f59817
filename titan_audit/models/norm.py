"""RMSNorm module (HF layout: one `weight` vector) over the last dimension.

Normalises in float32 and casts back before scaling, as Qwen3/Llama do; the arithmetic goes
through `ops.rms_norm`, so in batch-invariant mode a row's bits do not depend on other rows.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_audit.models import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, tp_group=None) -> torch.Tensor:  # noqa: ANN001
        return ops.rms_norm(x, self.weight, self.eps, tp_group)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
