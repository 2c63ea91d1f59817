"""Where the piece of a parameter this rank holds lies in the parameter's full tensor.

    block = local_block(param)      # (global shape, offset, local shape): a rectangular block
    block.index()                   # the slices that cut it from the full tensor
    block.flat_ranges()             # the same elements as [start, stop) ranges of the flat
                                    # (row-major) full tensor, in the local tensor's row-major order

A plain tensor is its own whole block. A DTensor's local tensor is the block torch's DTensor
layout gives this rank (`compute_local_shape_and_global_offset`, what DCP reads and writes
shards by): Shard(d) cuts dim d torch.chunk-style (chunk size ceil(n / mesh size), so the last
ranks may hold fewer rows or none), composed over the mesh dimensions (FSDP2's dim-0 shard of a
TP Shard(0) or Shard(1) piece on a (dp, tp) mesh included). Rows of a block cut on a later dim
(TP Shard(1)) are separate ranges; a block whole in every dim after its first cut dim is one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class LocalBlock:
    shape: tuple[int, ...]  # the full (global) tensor's
    offset: tuple[int, ...]  # where the block starts, per dim
    local_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.offset) == len(self.local_shape), self
        for n, o, k in zip(self.shape, self.offset, self.local_shape, strict=True):
            assert 0 <= k and (k == 0 or 0 <= o and o + k <= n), self

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def index(self) -> tuple[slice, ...]:
        """The slices that cut the block from the full tensor."""
        return tuple(slice(o, o + k) for o, k in zip(self.offset, self.local_shape, strict=True))

    def flat_ranges(self) -> Iterator[tuple[int, int]]:
        """The block's elements as [start, stop) ranges of the flat full tensor, in local order."""
        if self.numel == 0:
            return
        cut = [d for d, (n, k) in enumerate(zip(self.shape, self.local_shape, strict=True)) if k != n]
        if not cut:
            yield 0, self.numel
            return
        last = cut[-1]  # dims after it are whole: each run of `last` and after is contiguous
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        run = self.local_shape[last] * strides[last]
        outer = (range(self.offset[d], self.offset[d] + self.local_shape[d]) for d in range(last))
        for index in itertools.product(*outer):
            start = sum(i * s for i, s in zip(index, strides, strict=False)) + self.offset[last] * strides[last]
            yield start, start + run


def local_block(param: torch.Tensor) -> LocalBlock:
    """The block of `param`'s full tensor that this rank holds (see the module doc)."""
    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return LocalBlock(shape, (0,) * len(shape), shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    block = LocalBlock(shape, tuple(offset), tuple(local_shape))
    assert tuple(param.to_local().shape) == block.local_shape, (param.to_local().shape, block)
    return block
