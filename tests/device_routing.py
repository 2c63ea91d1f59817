"""Test helper: `routed_to_device()` hashes every tensor as a GPU rank's piece is hashed (the
lanes and statistics computed with torch ops and left where they were computed, audit/shards.py
`hashed_on_device`), on CPU tensors, and counts the reads of one tensor's lanes or statistics to
the host (`device_lanes.read_lanes`, `summary._device_absmax_sum`), which on a GPU would each wait
for the device. `read_at_once()`, inside it, makes the exchanges read each share at once instead
(the control: those reads are counted)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from titan_audit.audit import device_lanes, exchange, shards, summary
from titan_audit.batch_invariant.cpu import lattice


@contextlib.contextmanager
def routed_to_device() -> Iterator[list[int]]:
    """Inside: every piece hashed on the device path; yields [reads of one tensor so far]."""
    reads = [0]

    def counted(fn):
        def call(*args, **kwargs):
            reads[0] += 1
            return fn(*args, **kwargs)

        return call

    saved = (shards.hashed_on_device, device_lanes.read_lanes, summary._device_absmax_sum)
    shards.hashed_on_device = lambda local: True
    device_lanes.read_lanes = counted(device_lanes.read_lanes)
    summary._device_absmax_sum = counted(summary._device_absmax_sum)
    try:
        yield reads
    finally:
        shards.hashed_on_device, device_lanes.read_lanes, summary._device_absmax_sum = saved


@contextlib.contextmanager
def read_at_once() -> Iterator[None]:
    """Inside: each share's lanes and partial statistics read to the host as they are computed."""

    def share_sums(local, where):
        return torch.tensor([lattice.to_signed(v) for v in shards.share_lanes(local, where)], dtype=torch.int64)

    def sums(local, piece, positions=None):
        return torch.tensor([lattice.to_signed(v) for v in shards.lanes(local, piece, positions)], dtype=torch.int64)

    def partial_stats(local):
        return torch.tensor(summary.absmax_sum(local), dtype=torch.float64)

    saved = (exchange.share_sums, shards.sums, summary.partial_stats)
    exchange.share_sums, shards.sums, summary.partial_stats = share_sums, sums, partial_stats
    try:
        yield
    finally:
        exchange.share_sums, shards.sums, summary.partial_stats = saved
