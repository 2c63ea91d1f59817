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
- `rl rl-tiny W=1 vs TRL` (target <= 0.8): baseline TRL's GRPOTrainer on the same config with 1
  intra-op thread (bench/trl_peer.py: our init exported to HF, the same prompts, group size,
  prompts per step, completion length, temperature, reward, lr and AdamW shape; median seconds per
  step after the first, in a subprocess), candidate the first case's `BI mode` side (W = 1,
  parallel.threads = 1).
- `rl rl-tiny all cores (W=2 vs TRL threads=2)` (target <= 0.8): our BI mode on CORES = 2 ranks
  of 1 thread each (`launch(RL_JOB, nproc=2)`: torchrun; rank 0's metrics) against TRL with 2 intra-op
  threads. CORES is the 2 cores of the project's reference machines, not os.cpu_count().
  Extra keys of the TRL cases: `trl_version`, `trl_optimizer`, `trl_loss_type`.
- `rl rl-tiny W=1 threads=2 vs threads=1` (target <= THREADS_TARGET_RATIO = 1.0: a second
  intra-op thread must not slow the step): baseline the first case's `BI mode` side (1 thread),
  candidate the same run with parallel.threads = 2 (`THREADS_SIDE`). Runs without trl too; left
  out of `--quick` (THREADS_QUICK_SKIP). Same extra keys as the first case's candidate.
- `rl qwen3-0.6b widths L=2 W=1 vs TRL` (target <= REAL_WIDTH_TARGET_RATIO = 1.0): the rl-tiny
  recipe with the model section replaced (`REAL_WIDTH`: model.preset = qwen3-0.6b with
  model.overrides.num_hidden_layers = 2, i.e. hidden 1024, 16/8 heads, head_dim 128, intermediate
  3072, vocab 151936 tied; ~187M parameters) and a smaller shape so a side takes seconds to tens of
  seconds a step: 2 prompts x 4 samples x 16 new tokens, REAL_WIDTH_STEPS = 5 steps (4 timed:
  the first steps at this width still grow the heap, see memory_policy.py), W = 1,
  parallel.threads = 1. Baseline TRL with 1 thread on the same config (the vocab is the
  model's 151936; the byte tokenizer's ids stay < 258, so TRL gets our prompt ids and the model's
  vocab size, which trl_peer checks), candidate our BI mode (`launch(RL_JOB, ...)`, as the first case).
  Sides run min(repeats, REAL_WIDTH_REPEATS) times. Same extra keys as the other TRL cases.
When trl cannot be imported (`trl_peer.trl_missing`; the `peers` extra installs it), the TRL
cases are skipped, never given a figure: a warning line on stderr names each, and the first case's
`skipped` key lists them with the reason. `--quick` runs the W=1 TRL case at the quick shape and
skips the all-cores case the same way (QUICK_SKIP: torchrun's start and a second TRL process
would be most of a smoke run's time) and the real-width case (REAL_WIDTH_QUICK_SKIP).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from titan_audit.audit.run_metrics import read_metrics
from titan_audit.bench import trl_peer
from titan_audit.bench.core import BenchOptions, Case

log = logging.getLogger(__name__)

TRL_TARGET_RATIO = 0.8  # our BI step <= 0.8x TRL's step on the same cores
REAL_WIDTH_TARGET_RATIO = 1.0  # at real width: our BI step <= TRL's
THREADS_TARGET_RATIO = 1.0  # BI at W=1: 2 intra-op threads no slower than 1
CORES = 2  # the all-cores case: our W = CORES ranks x 1 thread against TRL with CORES threads
TRL_CASE = "rl rl-tiny W=1 vs TRL"
TRL_ALL_CORES_CASE = f"rl rl-tiny all cores (W={CORES} vs TRL threads={CORES})"
PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")
NATIVE, BI = "native ops", "BI mode"
BI_ALL_CORES = f"BI mode, W={CORES} (1 thread per rank)"
TRL_1, TRL_ALL_CORES = "TRL GRPOTrainer, 1 thread", f"TRL GRPOTrainer, {CORES} threads"
SIDES = {NATIVE: ["determinism.batch_invariant=false"], BI: []}
THREADS_SIDE = "BI mode, 2 threads"
THREADS_CASE = "rl rl-tiny W=1 threads=2 vs threads=1"
QUICK_SKIP = "left out of --quick (torchrun's start and a second TRL process); the full suite runs it"
QUICK = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "sampling.max_new_tokens=4"]
REAL_WIDTH = [
    "model.preset='qwen3-0.6b'",
    "model.overrides.num_hidden_layers=2",
    "task.prompts_per_step=2",
    "task.samples_per_prompt=4",
    "sampling.max_new_tokens=16",
    "parallel.threads=1",
]
REAL_WIDTH_CASE = "rl qwen3-0.6b widths L=2 W=1 vs TRL"
REAL_WIDTH_STEPS, REAL_WIDTH_REPEATS = 5, 2
BI_REAL, TRL_REAL = "BI mode, qwen3-0.6b widths L=2", "TRL GRPOTrainer, 1 thread, qwen3-0.6b widths L=2"
THREADS_QUICK_SKIP = "left out of --quick (a third rl-tiny run); the full suite runs it"
REAL_WIDTH_QUICK_SKIP = "left out of --quick (a ~187M-parameter model: its init and steps take seconds each)"


def _config(overrides: list[str], quick: bool, steps: int | None = None):
    from titan_audit.rl.config import load_rl_config

    steps = steps or (2 if quick else 4)
    base = [f"steps={steps}", "audit.level='off'", "checkpoint.interval=0", *(QUICK if quick else [])]
    return load_rl_config("rl-tiny", [*base, *overrides])


def real_width_config(overrides: list[str] = ()):
    """The real-width case's RLConfig (both sides run it): rl-tiny with REAL_WIDTH, then `overrides`."""
    return _config([*REAL_WIDTH, *overrides], quick=False, steps=REAL_WIDTH_STEPS)


def _run_side(overrides: list[str], quick: bool, out: Path, nproc: int | None = None, config=None) -> dict[str, float]:
    """Median seconds per step (and per phase) over the steps after the first (rank 0's metrics)."""
    from titan_audit.rl.loop import RL_JOB
    from titan_audit.trainer.launch import LaunchOptions, launch

    rc = launch(RL_JOB, config or _config(overrides, quick), out, nproc=nproc, options=LaunchOptions(quiet=True))
    if rc != 0:
        raise RuntimeError(f"bench rl: the run in {out} (nproc {nproc}) exited with code {rc}")
    rows = read_metrics(out).to_pylist()[1:]
    keys = ["seconds", *(f"seconds_{p}" for p in PHASES)]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def rl_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    missing = trl_peer.trl_missing()
    sides = (*SIDES, THREADS_SIDE, BI_ALL_CORES, TRL_1, TRL_ALL_CORES, BI_REAL, TRL_REAL)
    best = {side: {"seconds": float("inf")} for side in sides}

    def keep(side: str, figures: dict) -> None:
        if figures["seconds"] < best[side]["seconds"]:
            best[side] = figures

    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-rl-") as tmp:
        for repeat in range(1 if options.quick else options.repeats):
            for i, (side, overrides) in enumerate(SIDES.items()):
                keep(side, _run_side(overrides, options.quick, Path(tmp) / f"r{repeat}-s{i}"))
            if not options.quick:
                keep(THREADS_SIDE, _run_side(["parallel.threads=2"], False, Path(tmp) / f"r{repeat}-t2"))
            if missing is None:
                keep(TRL_1, trl_peer.trl_step_seconds(_config([], options.quick), threads=1))
            if missing is None and not options.quick:
                keep(BI_ALL_CORES, _run_side([], options.quick, Path(tmp) / f"r{repeat}-w{CORES}", nproc=CORES))
                keep(TRL_ALL_CORES, trl_peer.trl_step_seconds(_config([], options.quick), threads=CORES))
        if missing is None and not options.quick:
            for repeat in range(min(options.repeats, REAL_WIDTH_REPEATS)):
                keep(BI_REAL, _run_side([], False, Path(tmp) / f"real-r{repeat}", config=real_width_config()))
                keep(TRL_REAL, trl_peer.trl_step_seconds(real_width_config(), threads=1))
    extra = {f"baseline_seconds_{p}": best[NATIVE][f"seconds_{p}"] for p in PHASES}
    extra |= {f"candidate_seconds_{p}": best[BI][f"seconds_{p}"] for p in PHASES}
    name = "rl rl-tiny W=1"
    cases = [_case(name, NATIVE, BI, best[NATIVE]["seconds"], best[BI]["seconds"], None, extra)]
    progress(name)
    if options.quick:
        skipped_threads = [(THREADS_CASE, THREADS_QUICK_SKIP)]
    else:
        extra = {f"candidate_seconds_{p}": best[THREADS_SIDE][f"seconds_{p}"] for p in PHASES}
        threads = (best[BI]["seconds"], best[THREADS_SIDE]["seconds"])
        cases.append(_case(THREADS_CASE, BI, THREADS_SIDE, *threads, THREADS_TARGET_RATIO, extra))
        progress(THREADS_CASE)
        skipped_threads = []
    if missing is not None:
        skipped = [*skipped_threads, *((c, missing) for c in (TRL_CASE, TRL_ALL_CORES_CASE, REAL_WIDTH_CASE))]
    elif options.quick:
        skipped = [*skipped_threads, (TRL_ALL_CORES_CASE, QUICK_SKIP), (REAL_WIDTH_CASE, REAL_WIDTH_QUICK_SKIP)]
    else:
        skipped = []
    for case, reason in skipped:
        log.warning("bench rl: skipped case %r: %s", case, reason)
    if skipped:
        cases[0].extra["skipped"] = [{"case": c, "reason": r} for c, r in skipped]
    if missing is not None:
        return cases
    peers = [(TRL_CASE, TRL_1, BI, TRL_TARGET_RATIO)]
    if not options.quick:
        peers.append((TRL_ALL_CORES_CASE, TRL_ALL_CORES, BI_ALL_CORES, TRL_TARGET_RATIO))
        peers.append((REAL_WIDTH_CASE, TRL_REAL, BI_REAL, REAL_WIDTH_TARGET_RATIO))
    for name, trl_side, ours, target in peers:
        trl = best[trl_side]
        extra = {f"candidate_seconds_{p}": best[ours][f"seconds_{p}"] for p in PHASES}
        extra |= {
            "trl_version": trl["trl_version"],
            "trl_optimizer": trl["optimizer"],
            "trl_loss_type": trl["loss_type"],
        }
        cases.append(_case(name, trl_side, ours, trl["seconds"], best[ours]["seconds"], target, extra))
        progress(name)
    return cases


def _case(name, baseline, candidate, baseline_s, candidate_s, target, extra) -> Case:
    return Case(name, baseline, candidate, baseline_s, candidate_s, candidate_s / baseline_s, target, extra)
