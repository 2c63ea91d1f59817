"""Deterministic weight initialisation from a seed.

Every parameter draws from its own counter-based stream keyed by (seed, "model-init/<name>"),
generated on CPU in float32 and then cast/copied: the weights depend only on (config, seed, the
parameter's name), not on the device, the dtype of the draw, the order modules were built in,
or the other parameters. RMSNorm weights start at 1; everything else ~ N(0, initializer_range).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_audit.deterministic import torch_generator
from titan_audit.models.norm import RMSNorm


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    norm_params = {
        id(module.weight) for module in model.modules() if isinstance(module, RMSNorm)
    }
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        generator = torch_generator(seed, f"model-init/{name}", 0, 0)
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        param.copy_(values)
