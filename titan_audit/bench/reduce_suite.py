"""`bench reduce`: the deterministic tree reduction against `all_reduce`, on gloo, W = 2 and 4.

Both sides start by refilling the same V/W per-microbatch gradient buffers on each rank (V = 8),
allocated once as the trainer's are (a fresh 64 MB tensor per call would cost page faults that
dwarf the communication and hide its difference), and end with the summed gradient on every rank.
Baseline: sequential local sum, then `dist.all_reduce`. Candidate: `TreeReducer` (local tree
merge, exchange of partial-sum chunks, finish the tree per chunk, all-gather; the chunks travel
through a shared-memory file when every rank is on this host, as here, else over gloo: the
candidate's name says which).
Times are rank 0's, per reduction, min over repeats, baseline and candidate interleaved; iteration
counts are fixed on rank 0 and broadcast so every rank runs the same collectives.
Target: <= 1.25x.

A second group of cases times the tensor-parallel partial sums (`all_reduce_partials`: one partial
per rank, an activation-sized [tokens, dim] float32 block, summed in the fixed tree over the rank
index) against `dist.all_reduce` of the same partial, with the same target.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_audit.bench.core import BenchOptions, Case
from titan_audit.trainer.local_ranks import run_local_ranks
from titan_audit.trainer.reduce import TreeReducer, all_reduce_partials

TARGET_RATIO = 1.25
NUM_MICROBATCHES = 8
SIZES_MB = [1, 4, 16, 64]
QUICK_SIZES_MB = [1]
# TP partials: [tokens, dim] float32 activations (256 x 768 is 0.75 MB)
PARTIAL_SHAPES = [(64, 768), (256, 768), (1024, 768)]
QUICK_PARTIAL_SHAPES = [(256, 768)]


def _time_collective(fn: Callable[[], object], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _rank_main(rank: int, world_size: int, sizes_mb: list[int], repeats: int) -> list[dict]:
    out = []
    for size_mb in sizes_mb:
        numel = size_mb * (1 << 20) // 4
        reducer = TreeReducer(NUM_MICROBATCHES)
        start, stop = reducer.block
        g = torch.Generator().manual_seed(rank)
        leaves = [torch.randn(numel, generator=g) for _ in range(stop - start)]
        buffers = [torch.empty_like(leaf) for leaf in leaves]

        def refill() -> list[torch.Tensor]:
            for buffer, leaf in zip(buffers, leaves):
                buffer.copy_(leaf)
            return buffers

        def baseline() -> None:
            total, *others = refill()
            for other in others:
                total += other
            dist.all_reduce(total)

        def candidate() -> None:
            for i, buffer in zip(range(start, stop), refill()):
                reducer.add(i, buffer)
            reducer.all_reduce()

        baseline(), candidate()  # warm up
        calls = torch.tensor([max(1, 64 // size_mb)])
        dist.broadcast(calls, src=0)
        base_s = cand_s = float("inf")
        for _ in range(repeats):  # interleave so noise hits both alike
            base_s = min(base_s, _time_collective(baseline, int(calls), 1))
            cand_s = min(cand_s, _time_collective(candidate, int(calls), 1))
        out.append({"size_mb": size_mb, "baseline_s": base_s, "candidate_s": cand_s, "transport": reducer.transport})
    return out


def _partials_rank_main(rank: int, world_size: int, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    out = []
    for shape in shapes:
        g = torch.Generator().manual_seed(rank)
        partial = torch.randn(shape, generator=g)
        buffer = torch.empty_like(partial)

        def baseline() -> None:
            buffer.copy_(partial)
            dist.all_reduce(buffer)

        def candidate() -> None:
            buffer.copy_(partial)
            all_reduce_partials(buffer)

        baseline(), candidate()  # warm up
        calls = torch.tensor([max(4, (1 << 24) // partial.numel())])
        dist.broadcast(calls, src=0)
        base_s = cand_s = float("inf")
        for _ in range(repeats):
            base_s = min(base_s, _time_collective(baseline, int(calls), 1))
            cand_s = min(cand_s, _time_collective(candidate, int(calls), 1))
        out.append({"shape": list(shape), "baseline_s": base_s, "candidate_s": cand_s})
    return out


def _both_rank_main(rank: int, world_size: int, sizes_mb, shapes, repeats: int) -> tuple[list[dict], list[dict]]:
    return _rank_main(rank, world_size, sizes_mb, repeats), _partials_rank_main(rank, world_size, shapes, repeats)


def _case(name: str, baseline: str, candidate: str, row: dict) -> Case:
    return Case(
        case=name,
        baseline=baseline,
        candidate=candidate,
        baseline_s=row["baseline_s"],
        candidate_s=row["candidate_s"],
        ratio=row["candidate_s"] / row["baseline_s"],
        target=TARGET_RATIO,
    )


def reduce_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    sizes = QUICK_SIZES_MB if options.quick else SIZES_MB
    shapes = QUICK_PARTIAL_SHAPES if options.quick else PARTIAL_SHAPES
    rows = {w: run_local_ranks(_both_rank_main, w, args=(sizes, shapes, options.repeats))[0] for w in (2, 4)}
    cases = []
    for world_size, (reduce_rows, _) in rows.items():  # one set of ranks per W ran both groups
        for row in reduce_rows:
            name = f"reduce W={world_size} V={NUM_MICROBATCHES} {row['size_mb']}MB"
            candidate = f"TreeReducer.all_reduce ({row['transport']})"
            cases.append(_case(name, "local sum + dist.all_reduce (gloo)", candidate, row))
            progress(name)
    for world_size, (_, partial_rows) in rows.items():
        for row in partial_rows:
            tokens, dim = row["shape"]
            name = f"TP partials W={world_size} {tokens}x{dim} f32"
            candidate = "all_reduce_partials: all-gather + fixed tree up to 1 MB, else the tree reducer"
            cases.append(_case(name, "dist.all_reduce (gloo)", candidate, row))
            progress(name)
    return cases
