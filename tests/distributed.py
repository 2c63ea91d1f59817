"""Run a function on W real processes joined by a gloo process group (for multi-rank tests).

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

`fn` must be a module-level function (it is pickled by reference into spawned processes).
Each rank's return value comes back in rank order; an exception on any rank fails the call.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, store_path: str, out_dir: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        import torch

        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = ()) -> list[Any]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(fn, world_size, store, tmp, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
