"""Deterministic weight initialisation from a seed.

Every parameter draws from its own counter-based stream keyed by (seed, "model-init/<name>"):
raw Philox words (integer arithmetic) turned into float32 normals by our own Box-Muller kernel
(`batch_invariant.cpu.random`), then cast/copied. The weights depend only on (config, seed, the
parameter's name): not on the device, the dtype, the order modules were built in, the other
parameters, or the CPU and ISA (torch's `normal_` would depend on the ISA ATen dispatches to).
RMSNorm weights start at 1; everything else ~ N(0, initializer_range).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from titan_audit.batch_invariant.cpu.random import normal_from_bits
from titan_audit.deterministic import numpy_generator
from titan_audit.models.norm import RMSNorm


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    norm_params = {id(module.weight) for module in model.modules() if isinstance(module, RMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        pairs = (param.numel() + 1) // 2
        bits = numpy_generator(seed, f"model-init/{name}", 0, 0).bit_generator.random_raw(pairs).view(np.uint32)
        values = normal_from_bits(bits, 0.0, std)[: param.numel()].reshape(param.shape)
        param.copy_(values)
