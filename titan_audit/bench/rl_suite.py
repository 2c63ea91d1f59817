"""`bench rl`: the rl-tiny GRPO step, BI mode against native ops, split into its phases; and TRL's
GRPOTrainer on the same shape when `trl` is installed (the `peers` extra).

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
- `rl rl-tiny W=1 vs TRL`: baseline TRL's GRPOTrainer step on the same Qwen3 shape, prompts, group
  size and new tokens, candidate our BI step; target <= 0.8 (issue 26). Without trl the case is not
  run: a warning line on stderr and the first case's `skipped` key says so (never a figure).
"""

from __future__ import annotations

import importlib.util
import logging
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from titan_audit.bench.core import BenchOptions, Case

log = logging.getLogger(__name__)

TRL_TARGET_RATIO = 0.8
PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")
NATIVE, BI, TRL = "native ops", "BI mode", "TRL GRPOTrainer"
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


def _trl_step_seconds(quick: bool, tmp: Path) -> float:
    """TRL's GRPOTrainer on our model (exported to an HF dir), the same prompts and lengths: the
    median step time over the steps after the first."""
    import time

    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from titan_audit import models
    from titan_audit.rl.user_task import build_task

    config = _config([], quick)
    model = models.build(config.model.model_config(), seed=config.seed)
    models.save_pretrained(model, tmp / "hf")
    task = build_task(config)
    P, G = config.task.prompts_per_step, config.task.samples_per_prompt
    prompts = [{"prompt": list(p.ids)} for p in task.prompts(1)[:P]] * config.steps
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=P * G,
        num_generations=G,
        max_completion_length=config.sampling.max_new_tokens,
        max_steps=config.steps,
        learning_rate=config.optimizer.lr,
        temperature=config.sampling.temperature,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        use_cpu=True,
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf")
    trainer = GRPOTrainer(
        model=hf_model, reward_funcs=reward, args=args, train_dataset=datasets.Dataset.from_list(prompts)
    )
    trainer.add_callback(Timer())
    trainer.train()
    return statistics.median(times[1:])


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
        if importlib.util.find_spec("trl") is None:
            reason = "trl not installed (pip install 'titan-audit[peers]')"
            log.warning("bench rl: skipped case 'rl rl-tiny W=1 vs TRL': %s", reason)
            cases[0].extra["skipped"] = [{"case": "rl rl-tiny W=1 vs TRL", "reason": reason}]
            return cases
        trl_s = min(_trl_step_seconds(options.quick, Path(tmp) / f"trl{r}") for r in range(1))
        name = "rl rl-tiny W=1 vs TRL"
        cases.append(_case(name, TRL, BI, trl_s, best[BI]["seconds"], TRL_TARGET_RATIO, {}))
        progress(name)
    return cases


def _case(name, baseline, candidate, baseline_s, candidate_s, target, extra) -> Case:
    return Case(name, baseline, candidate, baseline_s, candidate_s, candidate_s / baseline_s, target, extra)
