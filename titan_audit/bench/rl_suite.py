"""`bench rl`: the rl-tiny GRPO step, BI mode against native ops, split into its phases.

Workload: recipe `rl-tiny` (tiny-dense, reversal-short, 8 prompts x 8 samples, 16 new tokens, lag
0) at W = 1 from the same random init (the recipe's seed), audit off, checkpoint only at the end;
`--quick`: 2 steps of 2 prompts x 2 samples, 4 new tokens (a smoke run, figures not meaningful).
A side's time is the median step time (metrics.parquet `seconds`) over the steps after the first
(the warm-up step), minimum over `repeats` runs, the sides alternating run by run.

Cases:
- `rl rl-tiny W=1`: baseline `native ops` (determinism.batch_invariant=false), candidate `BI mode`
  (the RL default); no target. Extra keys per side (`baseline_` / `candidate_` prefix): the median
  seconds of each phase, `seconds_generate` (what the step waits for in `schedule.take`),
  `seconds_reward`, `seconds_logprobs` (trainer forward), `seconds_backward`, `seconds_optimizer`
  (tree reduction, clipping, optimizer step).
- `rl rl-tiny W=1 vs TRL` (TRL's GRPOTrainer on the same shape, target <= 0.8) is not built: trl
  cannot be installed beside vLLM here, so the case could never run. A warning line on stderr and
  the first case's `skipped` key say so (never a figure).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from titan_audit.bench.core import BenchOptions, Case

log = logging.getLogger(__name__)

TRL_CASE = "rl rl-tiny W=1 vs TRL"
TRL_NOT_BUILT = (
    "not implemented: the TRL GRPOTrainer peer needs trl, which this project's machines cannot install "
    "beside vLLM (trl 1.13 downgrades huggingface_hub and fsspec); issue 26"
)
PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")
NATIVE, BI = "native ops", "BI mode"
SIDES = {NATIVE: ["determinism.batch_invariant=false"], BI: []}
QUICK = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "sampling.max_new_tokens=4"]


def _config(overrides: list[str], quick: bool):
    from titan_audit.rl.config import load_rl_config

    steps = 2 if quick else 4
    base = [f"steps={steps}", "audit.level='off'", "checkpoint.interval=0", *(QUICK if quick else [])]
    return load_rl_config("rl-tiny", [*base, *overrides])


def _run_side(overrides: list[str], quick: bool, out: Path) -> dict[str, float]:
    """Median seconds per step (and per phase) over the steps after the first."""
    from titan_audit.rl.launch import launch_rl

    launch_rl(_config(overrides, quick), out, quiet=True)
    rows = pq.read_table(out / "metrics.parquet").to_pylist()[1:]
    keys = ["seconds", *(f"seconds_{p}" for p in PHASES)]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def rl_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    best = {side: {"seconds": float("inf")} for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-rl-") as tmp:
        for repeat in range(1 if options.quick else options.repeats):
            for i, (side, overrides) in enumerate(SIDES.items()):
                figures = _run_side(overrides, options.quick, Path(tmp) / f"r{repeat}-s{i}")
                if figures["seconds"] < best[side]["seconds"]:
                    best[side] = figures
        extra = {f"baseline_seconds_{p}": best[NATIVE][f"seconds_{p}"] for p in PHASES}
        extra |= {f"candidate_seconds_{p}": best[BI][f"seconds_{p}"] for p in PHASES}
        name = "rl rl-tiny W=1"
        cases = [_case(name, NATIVE, BI, best[NATIVE]["seconds"], best[BI]["seconds"], None, extra)]
        progress(name)
        log.warning("bench rl: skipped case %r: %s", TRL_CASE, TRL_NOT_BUILT)
        cases[0].extra["skipped"] = [{"case": TRL_CASE, "reason": TRL_NOT_BUILT}]
    return cases


def _case(name, baseline, candidate, baseline_s, candidate_s, target, extra) -> Case:
    return Case(name, baseline, candidate, baseline_s, candidate_s, candidate_s / baseline_s, target, extra)
