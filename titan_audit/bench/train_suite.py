"""`bench train`: trainer tokens/s, deterministic mode against the same trainer with determinism off.

Tiny cases: the real train loop (trainer/train.py) on tiny-dense at W = 2 on gloo (V = 8,
1 x 64-token microbatches, 1 intra-op thread per rank), audit off, checkpoint only at the end:
- baseline `determinism off`: no deterministic switches, gradients accumulated in .grad by
  autograd and one plain `dist.all_reduce` of the flattened gradient per step;
- candidate `deterministic`: deterministic switches, per-microbatch gradients into the fixed-tree
  TreeReducer (partial sums through a same-host shared file, else gloo), native ops (fixed microbatch shapes need
  no batch-invariant ops for G3). Target: >= 0.85x the baseline's tokens/s (ratio <=
  TARGET_DETERMINISTIC_RATIO = 1/0.85);
- second case `deterministic + BI ops` against `deterministic`: the same with the batch-invariant
  ops on, as RL needs them (our own CPU kernels, portable PortableAdamW). Target: <=
  TARGET_BI_RATIO = 1.2x the native deterministic step;
- third case `deterministic + BI ops` (op census recording) against the same with
  `determinism.census=off` (no census guards installed; the routes that define BI numerics stay):
  what keeping the census on in every BI run costs. Target: <= TARGET_CENSUS_RATIO = 1.05;
- fourth case, FSDP2 (`parallel.mode = "fsdp"`): the deterministic sharded tree (trainer/fsdp.py:
  an all_to_all of each layer's pieces, the tree on this rank's shard) against FSDP2 with
  determinism off (its own averaging reduce-scatter). Target: TARGET_DETERMINISTIC_RATIO.
Real-width case (`REAL_WIDTH`: the widths of qwen3-0.6b, hidden 1024, 16/8 heads, head_dim 128,
intermediate 3072, vocab 151936 tied, with 2 layers; ~187M parameters): `deterministic + BI ops`
against `deterministic` at W = 1, 1 thread, 2 x 64-token sequences per step as V = 2
microbatches, 6 steps (the first two or three still grow the heap and take fresh pages, see
memory_policy.py; the median of the last five is the steady step); target TARGET_BI_RATIO. A side
takes tens of seconds (the init of the model and ~3-15 s a step on 2 cores), so these sides run
min(repeats, REAL_WIDTH_REPEATS) times, and `--quick` leaves the case out.
A side's time is rank 0's median step time over the steps after the first (metrics.parquet),
minimum over the runs; the sides alternate run by run so machine noise hits them alike.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from titan_audit.audit.run_metrics import read_metrics
from titan_audit.bench.core import BenchOptions, Case
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.local_ranks import run_local_ranks

TARGET_DETERMINISTIC_RATIO = 1 / 0.85  # deterministic (native ops) against determinism off
TARGET_BI_RATIO = 1.2  # deterministic + BI ops against deterministic
TARGET_CENSUS_RATIO = 1.05  # census recording against census off
WORLD_SIZE = 2
DETERMINISM_OFF = "determinism off (plain all_reduce)"
DETERMINISTIC = "deterministic (tree reduction, native ops)"
BI = "deterministic + BI ops"
BI_NO_CENSUS = "deterministic + BI ops, census off"
FSDP_OFF = "FSDP2, determinism off (its own reduce-scatter)"
FSDP_DETERMINISTIC = "FSDP2 deterministic (sharded tree, native ops)"
SIDES = {
    DETERMINISM_OFF: ["determinism.enabled=false"],
    DETERMINISTIC: [],
    BI: ["determinism.batch_invariant=true"],
    BI_NO_CENSUS: ["determinism.batch_invariant=true", "determinism.census='off'"],
    FSDP_OFF: ["parallel.mode='fsdp'", "determinism.enabled=false"],
    FSDP_DETERMINISTIC: ["parallel.mode='fsdp'"],
}
REAL_WIDTH = [
    "model.preset='qwen3-0.6b'",
    "model.overrides.num_hidden_layers=2",
    "data.seq_len=64",
    "data.global_batch_size=2",
    "data.microbatch_size=1",
]
REAL_WIDTH_CASE = "train qwen3-0.6b widths L=2 W=1 V=2"
REAL_WIDTH_WORLD_SIZE, REAL_WIDTH_STEPS, REAL_WIDTH_REPEATS = 1, 6, 2
REAL_WIDTH_SIDES = {DETERMINISTIC: SIDES[DETERMINISTIC], BI: SIDES[BI]}


def _rank_main(rank: int, world_size: int, config_dict: dict, out: str) -> None:
    from titan_audit.trainer.train import train

    train(from_dict(config_dict), out, quiet=True)


def _step_seconds(
    overrides: list[str], steps: int, root: Path, name: str, world_size: int = WORLD_SIZE
) -> tuple[float, int]:
    config = load_config("tiny-dense", [f"steps={steps}", "audit.level='off'", "checkpoint.interval=0", *overrides])
    out = root / name
    run_local_ranks(_rank_main, world_size, args=(to_dict(config), str(out)), threads=config.parallel.threads)
    rows = read_metrics(out).to_pylist()
    return statistics.median(r["seconds"] for r in rows[1:]), rows[0]["tokens"]


def _case(name: str, baseline: str, candidate: str, best: dict[str, float], tokens: int, target: float) -> Case:
    return Case(
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


def train_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    steps = 4 if options.quick else 12
    best = dict.fromkeys(SIDES, float("inf"))
    tokens = 0
    cases = []
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-train-") as tmp:
        for repeat in range(1 if options.quick else options.repeats):
            for i, (side, overrides) in enumerate(SIDES.items()):
                seconds, tokens = _step_seconds(overrides, steps, Path(tmp), f"r{repeat}-s{i}")
                best[side] = min(best[side], seconds)
        for baseline, candidate, target in (
            (DETERMINISM_OFF, DETERMINISTIC, TARGET_DETERMINISTIC_RATIO),
            (DETERMINISTIC, BI, TARGET_BI_RATIO),
            (BI_NO_CENSUS, BI, TARGET_CENSUS_RATIO),
            (FSDP_OFF, FSDP_DETERMINISTIC, TARGET_DETERMINISTIC_RATIO),
        ):
            name = f"train tiny-dense W={WORLD_SIZE} V=8: {candidate}"
            cases.append(_case(name, baseline, candidate, best, tokens, target))
            progress(name)
        if options.quick:
            return cases
        real = dict.fromkeys(REAL_WIDTH_SIDES, float("inf"))
        for repeat in range(min(options.repeats, REAL_WIDTH_REPEATS)):
            for i, (side, overrides) in enumerate(REAL_WIDTH_SIDES.items()):
                seconds, tokens = _step_seconds(
                    [*REAL_WIDTH, *overrides],
                    REAL_WIDTH_STEPS,
                    Path(tmp),
                    f"real-r{repeat}-s{i}",
                    REAL_WIDTH_WORLD_SIZE,
                )
                real[side] = min(real[side], seconds)
        name = f"{REAL_WIDTH_CASE}: {BI}"
        cases.append(_case(name, DETERMINISTIC, BI, real, tokens, TARGET_BI_RATIO))
        progress(name)
    return cases
