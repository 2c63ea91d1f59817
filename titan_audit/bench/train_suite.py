"""`bench train`: trainer tokens/s, deterministic mode against the same trainer with determinism off.

All sides run the real train loop (trainer/train.py) on tiny-dense at W = 2 on gloo (V = 8,
1 x 64-token microbatches, 1 intra-op thread per rank), audit off, checkpoint only at the end:
- baseline `determinism off`: no deterministic switches, gradients accumulated in .grad by
  autograd and one plain `dist.all_reduce` of the flattened gradient per step;
- candidate `deterministic`: deterministic switches, per-microbatch gradients into the fixed-tree
  TreeReducer (all_to_all of partial sums + all_gather), native ops (fixed microbatch shapes need
  no batch-invariant ops for G3). Target: >= 0.85x the baseline's tokens/s (ratio <= 1/0.85);
- second case `deterministic + BI ops` against `deterministic`: the same with the batch-invariant
  ops on, as RL needs them (our own CPU kernels, portable PortableAdamW). Target: <= 1.5x the
  native deterministic step (issue 14);
- third case `deterministic + BI ops` (op census recording) against the same with
  `determinism.census=off` (no census guards installed; the routes that define BI numerics stay):
  what keeping the census on in every BI run costs. Target: <= 1.05 (issue 21).
A side's time is rank 0's median step time over the steps after the first (metrics.parquet),
minimum over `repeats` runs; the sides alternate run by run so machine noise hits them alike.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from titan_audit.bench.core import BenchOptions, Case
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.local_ranks import run_local_ranks

TARGET_RATIO = 1 / 0.85
TARGET_BI_RATIO = 1.5
TARGET_CENSUS_RATIO = 1.05
WORLD_SIZE = 2
SIDES = {
    "determinism off (plain all_reduce)": ["determinism.enabled=false"],
    "deterministic (tree reduction, native ops)": [],
    "deterministic + BI ops": ["determinism.batch_invariant=true"],
    "deterministic + BI ops, census off": ["determinism.batch_invariant=true", "determinism.census='off'"],
}


def _rank_main(rank: int, world_size: int, config_dict: dict, out: str) -> None:
    from titan_audit.trainer.train import train

    train(from_dict(config_dict), out, quiet=True)


def _step_seconds(overrides: list[str], steps: int, root: Path, name: str) -> tuple[float, int]:
    config = load_config("tiny-dense", [f"steps={steps}", "audit.level='off'", "checkpoint.interval=0", *overrides])
    out = root / name
    run_local_ranks(_rank_main, WORLD_SIZE, args=(to_dict(config), str(out)), threads=config.parallel.threads)
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    return statistics.median(r["seconds"] for r in rows[1:]), rows[0]["tokens"]


def train_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    steps = 4 if options.quick else 12
    best = dict.fromkeys(SIDES, float("inf"))
    tokens = 0
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-train-") as tmp:
        for repeat in range(1 if options.quick else options.repeats):
            for i, (side, overrides) in enumerate(SIDES.items()):
                seconds, tokens = _step_seconds(overrides, steps, Path(tmp), f"r{repeat}-s{i}")
                best[side] = min(best[side], seconds)
    native, deterministic, bi, bi_no_census = SIDES
    cases = []
    for baseline, candidate, target in (
        (native, deterministic, TARGET_RATIO),
        (deterministic, bi, TARGET_BI_RATIO),
        (bi_no_census, bi, TARGET_CENSUS_RATIO),
    ):
        name = f"train tiny-dense W={WORLD_SIZE} V=8: {candidate}"
        cases.append(
            Case(
                case=name,
                baseline=baseline,
                candidate=candidate,
                baseline_s=best[baseline],
                candidate_s=best[candidate],
                ratio=best[candidate] / best[baseline],
                target=target,
                extra={
                    "baseline_tokens_per_s": tokens / best[baseline],
                    "candidate_tokens_per_s": tokens / best[candidate],
                    "throughput_ratio": best[baseline] / best[candidate],
                    "tokens_per_step": tokens,
                },
            )
        )
        progress(name)
    return cases
