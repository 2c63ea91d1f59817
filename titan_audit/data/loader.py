"""The elastically deterministic loader: this rank's microbatches of the global batch plan.

    loader = ElasticLoader(LoaderConfig(store="corpus.zarr", seq_len=512, global_batch_size=64,
                                        microbatch_size=4), rank=r, world_size=W, state=saved)
    for mb in loader:            # this rank's V/W microbatches of each step, in index order
        loss = (token_loss(mb) * mb.loss_mask).sum() / mb.global_loss_tokens
    saved = loader.state()       # (epoch, step) of the next step + manifest: the same on every rank

Guarantees:
- Step s of epoch e delivers, on rank r of W, microbatches [r*V/W, (r+1)*V/W) of the global batch
  defined in plan.py (`interleaved`: r, r + W, ...); the concatenation over ranks is the global
  batch, bit for bit, for every W dividing V, because each microbatch is a pure function of
  (epoch, step, index) (batches.py).
- `state()` is the next step not yet fully delivered; a loader built with that state (any W
  dividing V) continues with exactly the microbatches an uninterrupted run would deliver. Resume
  costs O(1) in the step: nothing is replayed, the permutation is evaluated where needed.
- The source is checked at construction when a state is given: its batch spec must match (else
  ValueError naming the field) and its manifest must match the store's files and the store's
  recorded origin (else ValueError naming the changed file), unless allow_source_change=True.
- `workers`, `worker_type` and `prefetch` change only speed, never the delivered bytes.
Cost at construction: the store's manifest (xxh3 of its files) and its offsets (8 bytes per
document); best_fit packing also builds its plan (O(documents)). None of it depends on the step.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from titan_audit.data.batches import BatchSpec, GlobalBatches
from titan_audit.data.manifest import check_unchanged
from titan_audit.data.microbatch import Microbatch
from titan_audit.data.packing import PACKINGS
from titan_audit.data.prefetch import WORKER_TYPES, Prefetcher
from titan_audit.data.state import LoaderState
from titan_audit.data.token_store import TokenStore
from titan_audit.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class LoaderConfig:
    store: str  # a token store (see `titan-audit data prepare`)
    seq_len: int
    global_batch_size: int  # B sequences per step
    microbatch_size: int  # M sequences per virtual microbatch; V = B / M
    seed: int = 0
    packing: str = "concat"  # or "best_fit"
    num_epochs: int | None = None  # None: run forever
    workers: int = 0  # prefetch workers; 0 = inline
    worker_type: str = "thread"  # or "process"
    prefetch: int = 4  # microbatches computed ahead (>= 1)

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ValueError(f"unknown packing {self.packing!r}; choose from {', '.join(PACKINGS)}")
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(f"unknown worker type {self.worker_type!r}; choose from {', '.join(WORKER_TYPES)}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")

    @property
    def spec(self) -> BatchSpec:
        return BatchSpec(self.seq_len, self.global_batch_size, self.microbatch_size, self.seed, self.packing)


_worker_batches: GlobalBatches | None = None


def _worker_init(store: str, spec: BatchSpec) -> None:
    global _worker_batches
    _worker_batches = GlobalBatches(TokenStore(store), spec)


def _worker_compute(task: tuple[int, int, int]):
    assert _worker_batches is not None, "process worker not initialised"
    return _worker_batches.microbatch_arrays(*task)


def _default_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ElasticLoader:
    def __init__(
        self,
        config: LoaderConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        state: LoaderState | None = None,
        allow_source_change: bool = False,
        interleaved: bool = False,
    ) -> None:
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if rank is None:
            rank, world_size = _default_rank_world()
        assert world_size is not None
        self.config = config
        spec = config.spec
        self.store = TokenStore(config.store)
        self.batches = GlobalBatches(self.store, spec)
        self.rank, self.world_size = rank, world_size
        self.local_microbatches = self.batches.plan.rank_microbatches(rank, world_size, interleaved=interleaved)
        self.manifest = self.store.manifest()
        self.manifest_digest = self.manifest.digest()
        self.epoch, self.step = 0, 0
        if state is not None:
            self._resume(state, allow_source_change)
        if config.num_epochs is not None and self.epoch >= config.num_epochs:
            raise ValueError(f"state epoch {self.epoch} is past num_epochs={config.num_epochs}")
        if config.worker_type == "process" and config.workers > 0:
            self._prefetcher = Prefetcher(
                _worker_compute,
                workers=config.workers,
                depth=config.prefetch,
                kind="process",
                initializer=_worker_init,
                initargs=(os.fspath(config.store), spec),
            )
        else:
            self._prefetcher = Prefetcher(self._compute, workers=config.workers, depth=config.prefetch, kind="thread")

    def _resume(self, state: LoaderState, allow_source_change: bool) -> None:
        current = self.config.spec.to_dict()
        for key in sorted(set(current) | set(state.spec)):
            if current.get(key) != state.spec.get(key):
                raise ValueError(
                    f"loader state was saved with {key}={state.spec.get(key)!r} "
                    f"but the config has {key}={current.get(key)!r}; "
                    "these fix the global batches and cannot change on resume"
                )
        diffs = check_unchanged(state.manifest_digest, state.manifest, self.manifest, allow_change=allow_source_change)
        for line in diffs:
            log.warning("data source changed (allowed by allow_source_change): %s", line)
        if not 0 <= state.step < self.batches.steps_per_epoch or state.epoch < 0:
            raise ValueError(
                f"loader state (epoch {state.epoch}, step {state.step}) is outside the plan: an epoch has "
                f"{self.batches.steps_per_epoch} steps"
            )
        self.epoch, self.step = state.epoch, state.step

    # -- positions ---------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch

    @property
    def num_microbatches(self) -> int:
        return self.batches.num_microbatches

    @property
    def global_step(self) -> int:
        return self.epoch * self.steps_per_epoch + self.step

    def seek(self, global_step: int) -> None:
        """Position at a global step (counted from 0 across epochs), O(1)."""
        self.epoch, self.step = self.batches.position(global_step)

    def state(self) -> LoaderState:
        return LoaderState(self.epoch, self.step, self.config.spec.to_dict(), self.manifest_digest, self.manifest)

    # -- delivery ----------------------------------------------------------------------------------
    def _compute(self, task: tuple[int, int, int]):
        return self.batches.microbatch_arrays(*task)

    def _tasks(self, epoch: int, step: int) -> Iterator[tuple[int, int, int]]:
        while self.config.num_epochs is None or epoch < self.config.num_epochs:
            for index in self.local_microbatches:
                yield epoch, step, index
            step += 1
            if step == self.steps_per_epoch:
                epoch, step = epoch + 1, 0

    def __iter__(self) -> Iterator[Microbatch]:
        """This rank's microbatches from the current position on; advances the state per step."""
        last = self.local_microbatches[-1]
        loss_tokens: dict[tuple[int, int], int] = {}
        for (epoch, step, index), arrays in self._prefetcher.run(self._tasks(self.epoch, self.step)):
            key = (epoch, step)
            if key not in loss_tokens:
                loss_tokens.clear()
                loss_tokens[key] = self.batches.step_loss_tokens(epoch, step)
            if index == last:  # the whole step is handed out with this one: the state moves on
                following = step + 1
                self.epoch, self.step = (epoch + 1, 0) if following == self.steps_per_epoch else (epoch, following)
            yield Microbatch.from_arrays(epoch, step, index, self.num_microbatches, loss_tokens[key], arrays)

    def steps(self) -> Iterator[list[Microbatch]]:
        """This rank's microbatches grouped by step."""
        group: list[Microbatch] = []
        for mb in self:
            group.append(mb)
            if len(group) == len(self.local_microbatches):
                yield group
                group = []

    def global_batch(self, epoch: int, step: int) -> list[Microbatch]:
        """Every microbatch of (epoch, step), computed here (a reference for checks and audits)."""
        total = self.batches.step_loss_tokens(epoch, step)
        return [
            Microbatch.from_arrays(
                epoch, step, i, self.num_microbatches, total, self.batches.microbatch_arrays(epoch, step, i)
            )
            for i in range(self.num_microbatches)
        ]

    def close(self) -> None:
        self._prefetcher.close()

    def __enter__(self) -> ElasticLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
