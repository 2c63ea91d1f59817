"""Deterministic weight initialisation from a seed, whole or one shard at a time with the same bits.

Every parameter draws from its own counter-based stream keyed by (seed, "model-init/<name>"):
raw Philox words (integer arithmetic) turned into float32 normals by our own Box-Muller kernel
(`batch_invariant.cpu.random`), then cast/copied. The weights depend only on (config, seed, the
parameter's name): not on the device, the dtype, the order modules were built in, the other
parameters, or the CPU and ISA (torch's `normal_` would depend on the ISA ATen dispatches to).
RMSNorm weights start at 1; everything else ~ N(0, initializer_range).

Element e of a parameter's flat (row-major) tensor comes from the Box-Muller pair e // 2, that is
64-bit Philox word e // 2 of the stream (its low 32 bits are the pair's first word), and word w
from counter block w // 4 (Philox-4x64 makes 4 words per block). So any range [start, stop) of
elements is computed alone (`init_range`: the stream advanced to the block of the first pair,
the pairs around the range drawn whole and cut), with the bits the whole-tensor init gives
those elements, and `init_weights` fills a DTensor parameter's local shard (models/local_shard.py)
without making the full tensor on any rank.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.cpu.random import normal_from_bits
from titan_audit.deterministic import numpy_generator
from titan_audit.models.local_shard import local_block
from titan_audit.models.norm import RMSNorm

_WORDS_PER_BLOCK = 4  # Philox-4x64: one counter value gives 4 64-bit words
CHUNK = 1 << 20  # elements drawn at once: bounds the transient buffers, whatever the parameter's size


def init_range(seed: int, name: str, std: float, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of parameter `name`'s flat init, float32 (before the norm rule)."""
    assert 0 <= start <= stop, (start, stop)
    if start == stop:
        return torch.empty(0, dtype=torch.float32)
    first, end = start // 2, (stop + 1) // 2  # the pairs (64-bit words) holding the range
    block, skip = divmod(first, _WORDS_PER_BLOCK)
    bit_generator = numpy_generator(seed, f"model-init/{name}", 0, 0).bit_generator
    bit_generator.advance(block)  # as if `block` blocks of 4 words were drawn
    words = bit_generator.random_raw(skip + end - first)[skip:]
    values = normal_from_bits(words.view(np.uint32), 0.0, std)  # elements 2 * first ... 2 * end - 1
    return values[start - 2 * first : stop - 2 * first]


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter where it lives: a plain tensor whole, a DTensor's local shard
    only (the elements its local block holds, in CHUNK-sized draws)."""
    norm_params = {id(module.weight) for module in model.modules() if isinstance(module, RMSNorm)}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if id(param) in norm_params:
            local.fill_(1.0)
            continue
        assert local.is_contiguous(), name
        flat, offset = local.view(-1), 0
        for start, stop in local_block(param).flat_ranges():
            for a in range(start, stop, CHUNK):
                b = min(a + CHUNK, stop)
                flat[offset : offset + b - a].copy_(init_range(seed, name, std, a, b))
                offset += b - a
        assert offset == flat.numel(), (name, offset, flat.numel())
