"""The global batch plan (DESIGN.md section 3): which sequences make each virtual microbatch.

A step's global batch is `global_batch_size` (B) packed sequences, cut into V = B / M virtual
microbatches of `microbatch_size` (M) sequences. In epoch e, step s, microbatch m holds the
sequences perm_e(s*B + m*M + i) for i in [0, M), where perm_e is the epoch's Feistel permutation
of all packed sequences (permutation.py). An epoch has floor(N / B) steps; the N mod B sequences
left over differ from epoch to epoch. Rank r of W processes microbatches [r*V/W, (r+1)*V/W)
(or, interleaved, r, r + W, ...). Nothing here depends on W except which microbatches a rank
takes, so every W dividing V sees the same global batches. Invalid numbers are ValueErrors that name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    microbatch_size: int

    def __post_init__(self) -> None:
        if self.microbatch_size < 1 or self.global_batch_size < 1:
            raise ValueError(
                f"global batch size ({self.global_batch_size}) and microbatch size ({self.microbatch_size}) "
                "must be >= 1"
            )
        if self.global_batch_size % self.microbatch_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by microbatch size {self.microbatch_size}"
            )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    def check_world_size(self, world_size: int) -> None:
        if world_size < 1 or self.num_microbatches % world_size:
            raise ValueError(
                f"world size {world_size} does not divide the {self.num_microbatches} virtual microbatches "
                f"(global batch {self.global_batch_size} / microbatch {self.microbatch_size}); use a W dividing "
                f"{self.num_microbatches}"
            )

    def rank_microbatches(self, rank: int, world_size: int, *, interleaved: bool = False) -> range:
        """The microbatches rank r of W runs, in index order: the block [r*V/W, (r+1)*V/W), or
        `interleaved` r, r + W, r + 2W, ... (FSDP2's sharded tree: each round of W is one subtree)."""
        self.check_world_size(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if interleaved:
            return range(rank, self.num_microbatches, world_size)
        per_rank = self.num_microbatches // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def steps_per_epoch(self, num_sequences: int) -> int:
        return num_sequences // self.global_batch_size

    def order_slots(self, step: int, microbatch: int) -> np.ndarray:
        """Positions in the epoch's permuted order of microbatch `microbatch` of step `step`."""
        assert 0 <= microbatch < self.num_microbatches
        start = step * self.global_batch_size + microbatch * self.microbatch_size
        return np.arange(start, start + self.microbatch_size, dtype=np.int64)

    def step_slots(self, step: int) -> np.ndarray:
        start = step * self.global_batch_size
        return np.arange(start, start + self.global_batch_size, dtype=np.int64)
