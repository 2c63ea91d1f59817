"""Run a function on W local processes joined by a gloo process group.

    results = run_local_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args)

Used by multi-rank tests and bench suites; `titan-audit train --nproc N` uses torchrun instead.
`fn` must be importable by name (module level): it is pickled by reference into spawned
processes. Return values come back in rank order; an exception on any rank raises here. Each
rank runs with a fixed intra-op thread count (`threads`), never one derived from W.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, store_path: str, out_dir: str, args: tuple, threads: int
) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears down gloo while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # Leave without interpreter teardown: gloo threads of groups a DeviceMesh created can still be
    # alive then and abort the process ("terminate called without an active exception", ~5% of
    # runs here). The result is saved and the group destroyed, so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), threads: int = 1) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="titan-audit-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(fn, world_size, store, tmp, args, threads), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
