"""The global batches as a pure function: (epoch, step, microbatch) -> arrays.

`GlobalBatches` joins a token store, a packer (packing.py), the per-epoch permutation
(permutation.py) and the batch plan (plan.py). Every method is a pure function of its
arguments and of (store, seq_len, packing, seed, plan): no iteration state, no dependence on the
rank, the world size, the worker that calls it or what was computed before. That is what makes
prefetching in any number of workers and resuming at any step in O(1) exact.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from titan_audit.data.packing import make_packer
from titan_audit.data.permutation import FeistelPermutation
from titan_audit.data.plan import BatchPlan
from titan_audit.data.token_store import TokenStore


@dataclass(frozen=True)
class BatchSpec:
    """What fixes the sequence of global batches (besides the data)."""

    seq_len: int
    global_batch_size: int
    microbatch_size: int
    seed: int = 0
    packing: str = "concat"

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "microbatch_size": self.microbatch_size,
            "seed": self.seed,
            "packing": self.packing,
        }


class GlobalBatches:
    def __init__(self, store: TokenStore, spec: BatchSpec) -> None:
        self.store, self.spec = store, spec
        self.plan = BatchPlan(spec.global_batch_size, spec.microbatch_size)
        self.packer = make_packer(store, spec.seq_len, spec.packing)
        self.num_sequences = self.packer.num_sequences
        self.steps_per_epoch = self.plan.steps_per_epoch(self.num_sequences)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{store.path}: {self.num_sequences} packed sequences of length {spec.seq_len} cannot fill one global "
                f"batch of {spec.global_batch_size}"
            )
        self._perm: tuple[int, FeistelPermutation] | None = None
        self._lock = threading.Lock()

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches

    def permutation(self, epoch: int) -> FeistelPermutation:
        with self._lock:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, FeistelPermutation.for_epoch(self.num_sequences, self.spec.seed, epoch))
            return self._perm[1]

    def _check(self, epoch: int, step: int) -> None:
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"(epoch {epoch}, step {step}) is outside the plan: an epoch has {self.steps_per_epoch} steps"
            )

    def sequence_ids(self, epoch: int, step: int, microbatch: int) -> np.ndarray:
        self._check(epoch, step)
        return self.permutation(epoch)(self.plan.order_slots(step, microbatch))

    def step_loss_tokens(self, epoch: int, step: int) -> int:
        """Loss-mask count over the whole global batch of (epoch, step): the loss normaliser."""
        self._check(epoch, step)
        return int(self.packer.loss_tokens(self.permutation(epoch)(self.plan.step_slots(step))).sum())

    def microbatch_arrays(self, epoch: int, step: int, microbatch: int) -> dict[str, np.ndarray]:
        ids = self.sequence_ids(epoch, step, microbatch)
        rows = [self.packer.sequence(int(j)) for j in ids]
        return {
            "sequence_ids": ids,
            "tokens": np.stack([r.tokens for r in rows]),
            "targets": np.stack([r.targets for r in rows]),
            "positions": np.stack([r.positions for r in rows]),
            "doc_ids": np.stack([r.doc_ids for r in rows]),
            "loss_mask": np.stack([r.loss_mask for r in rows]),
        }

    def position(self, global_step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step counted from 0."""
        if global_step < 0:
            raise ValueError(f"global step must be >= 0, got {global_step}")
        return divmod(global_step, self.steps_per_epoch)
