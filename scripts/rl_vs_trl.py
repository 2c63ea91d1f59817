#!/usr/bin/env python
"""Does our GRPO learn like TRL's? The same start, prompts, reward and hyperparameters, side by side.

    .venv/bin/python scripts/rl_vs_trl.py --init runs/rl-warmup                # built-in task, 5 seeds, 300 steps
    .venv/bin/python scripts/rl_vs_trl.py --init runs/rl-warmup --rl recipes/rl-user-task.toml --out runs/rl-vs-trl-user
    .venv/bin/python scripts/rl_vs_trl.py --init runs/rl-warmup --steps 100 --seeds 0 1

From one warm-up run (`--init`, e.g. the README's `recipes/rl-warmup.toml` run) and one RL recipe
(`--rl`: a name or a TOML file; its task is built-in, or the user's prompts file and reward
functions), for each seed s:
- ours, BI mode: `titan-audit rl --config RL --init INIT --steps N --set seed=s` (OUT/ours-bi-sS);
- ours, native ops: the same with `determinism.batch_invariant=false` (OUT/ours-native-sS);
- TRL: GRPOTrainer (`trl`, the `peers` extra; without it the variant is skipped with a line that
  says so) started from INIT exported as an HF directory (`titan-audit export`, OUT/init-hf), on
  the prompts of our run's steps 1..N in order (`shuffle_dataset=False`) with our byte tokenizer's
  ids (bench/trl_peer.py `byte_tokenizer`), checked to be our prompts' ids:
  built-in task: `rl.tasks.prompt_set(task, s, step, P)`, scored by our task's reward
  (`rl.tasks.score` of the text before EOS; bench/trl_peer.py `task_reward`);
  user task: the rows `rl.user_task.UserTask.prompts(step)` picks (the row's prompt and its other
  columns), scored by the recipe's own reward functions, which TRL calls itself with
  `reward_weights` = task.reward_weights (so they must take TRL's extra arguments: **kwargs);
  G generations per prompt, P prompts per optimizer step (gradient accumulation), our
  temperature, max_new_tokens, lr, betas, eps, weight decay, grad clip, clip epsilon and KL
  coefficient, a constant schedule, loss_type "dapo" (token-level over the step's tokens, as
  ours), TRL's defaults scale_rewards "group" and multi_objective_aggregation "sum_then_normalize"
  (as ours: the weighted sum of the rewards, then the group's normalisation), its k3 KL estimator
  without the importance-ratio factor (use_bias_correction_kl=False, as ours), no vLLM (so no
  importance-sampling correction), seed s (OUT/trl-sS/rewards.json: the mean reward of each
  step, from TRL's log).
The differences that remain by definition are REMAINING below; the report lists them.

TRL's sampling is not deterministic, so the comparison is statistical: per seed and variant the
mean reward of the first 10 and last 10 steps and the gain; per variant the mean and min gain;
then the verdicts (`verdicts`): TRL's mean gain and the standard error of its seeds' gains (SE =
sample std / sqrt(seeds)); TRL learns (mean gain >= +0.10); our BI mean gain >= TRL's mean - 2 SE;
our native mean within 2 SE of our BI mean. Writes OUT/table.md and OUT/learning.html (one
self-contained page: the reward per step, rolling mean over 10 steps, mean over seeds with the
min-max band; the table and verdicts below it) and prints the table. Runs already complete in OUT
are reused; OUT/comparison.json records the init, recipe and steps, and another combination is
refused. Every command's output goes to OUT/<run>.log.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "titan_audit.cli"]
VARIANTS = ("ours-bi", "ours-native", "trl")
COLORS = {"ours-bi": "#1f77b4", "ours-native": "#2ca02c", "trl": "#d62728"}
LEARNS = 0.10  # TRL "learns" when its mean gain over the seeds reaches this
MARGIN_SE = 2.0  # the margins of the verdicts, in standard errors of TRL's seeds' gains
STATISTICAL = (
    "The comparison is statistical: TRL samples with torch's generator and HF kernels, not deterministically, "
    "so its seeds' gains are a sample and the margins are two standard errors of it (SE = sample std / sqrt(seeds))."
)
REMAINING = (
    "advantages: ours divide by the population std + 1e-6 (rl/loss.py), TRL by the Bessel-corrected nanstd + 1e-4;",
    "completion_ids: TRL passes a reward function the ids with the first EOS, ours without it (rl/user_task.py); "
    "the completion texts are the same (the text before EOS) and both train on the EOS token;",
    "sampling: TRL samples from torch's generator with HF transformers' kernels, ours from keyed uniforms through "
    "our kernels (BI or native);",
    "optimizer: TRL steps torch's AdamW, ours our portable AdamW (the same lr, betas, eps, weight decay, clip).",
)


def log(message: str) -> None:
    print(f"[rl_vs_trl {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(command: list[str], logfile: Path, env: dict | None = None) -> None:
    log("$ " + " ".join(command[2:] if command[:2] == [sys.executable, "-m"] else command))
    t0 = time.perf_counter()
    with open(logfile, "w") as sink:
        rc = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env).returncode
    log(f"  exit {rc} after {time.perf_counter() - t0:.0f} s (log: {logfile})")
    if rc:
        raise SystemExit(f"failed: {' '.join(command)} (see {logfile})")


def ours_rewards(run_dir: Path, steps: int) -> list[float] | None:
    from titan_audit.audit.run_metrics import read_metrics

    table = read_metrics(run_dir) if run_dir.exists() else None
    rows = [] if table is None else sorted(table.to_pylist(), key=lambda r: r["step"])
    return [r["reward_mean"] for r in rows[:steps]] if len(rows) >= steps else None


def trl_rewards(run_dir: Path, steps: int) -> list[float] | None:
    path = run_dir / "rewards.json"
    values = json.loads(path.read_text()) if path.is_file() else []
    return values[:steps] if len(values) >= steps else None


# ---------------------------------------------------------------------------------- TRL worker
def trl_task(config, tokenizer) -> tuple[list[dict], list, list[float] | None]:
    """The rows TRL walks in order (our prompts of steps 1..config.steps), the reward functions it
    calls and their weights (None: TRL's default), for the built-in task or the user's."""
    from titan_audit.bench.trl_peer import matched_rows, task_reward
    from titan_audit.rl.user_task import build_task

    if config.task.prompts is None:
        return matched_rows(config, config.steps, tokenizer), [task_reward], None
    task = build_task(config)
    rows = []
    for step in range(1, config.steps + 1):
        for prompt in task.prompts(step):
            ids = tuple(tokenizer(text=task.raw[prompt.row])["input_ids"])
            assert ids == prompt.ids, f"byte tokenizer ids differ on row {prompt.row}"
            rows.append({"prompt": task.raw[prompt.row], **task.extra[prompt.row]})
    return rows, [reward.fn for reward in task.rewards], task.weights


def check_trl_task(config) -> str | None:
    """Why TRL cannot run this recipe's task here (None: it can): the byte tokenizer only, and a
    user task's prompts in column `prompt` with no other column of that name."""
    if config.tokenizer.path is not None or config.tokenizer.chat_template:
        return "tokenizer.path: the TRL side runs the byte tokenizer only"
    if config.task.prompts is not None and config.task.prompt_column != "prompt":
        return f"task.prompt_column {config.task.prompt_column!r}: the TRL side reads the prompts from 'prompt'"
    return None


def trl_worker(spec_path: Path) -> None:
    """One TRL run (a subprocess: its threads and imports stay its own); see the module docstring."""
    spec = json.loads(spec_path.read_text())
    import torch

    torch.set_num_threads(1)
    sys.modules["vllm"] = None  # use_vllm=False: trl then never imports vLLM
    import datasets
    import transformers
    import trl

    from titan_audit.bench.trl_peer import byte_tokenizer, grpo_args
    from titan_audit.rl.config import load_rl_config

    config = load_rl_config(spec["rl"], [f"seed={spec['seed']}", f"steps={spec['steps']}"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = byte_tokenizer()
    rows, reward_funcs, weights = trl_task(config, tokenizer)
    # loss_type "dapo": the loss over the step's tokens, as ours; the KL term without TRL's
    # importance-ratio factor, as ours (no effect at kl_coef 0); a reward logged every step
    args = grpo_args(
        trl,
        config,
        spec["out"],
        config.steps,
        loss_type="dapo",
        use_bias_correction_kl=False,
        reward_weights=weights,
        logging_strategy="steps",
        logging_steps=1,
    )
    rewards: list[float] = []

    class Rewards(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Rewards()],
    )
    trainer.train()
    assert len(rewards) == config.steps, f"TRL logged {len(rewards)} step rewards of {config.steps}"
    Path(spec["out"], "rewards.json").write_text(json.dumps(rewards))


# ---------------------------------------------------------------------------------- the verdicts
def gain(values: list[float]) -> tuple[float, float, float]:
    """(mean reward of the first 10 steps, of the last 10, last - first)."""
    first, last = sum(values[:10]) / 10, sum(values[-10:]) / 10
    return first, last, last - first


@dataclass(frozen=True)
class Verdicts:
    """The report's verdicts from the variants' gains per seed (module docstring); a verdict on a
    variant that did not run is None."""

    seeds: int  # TRL's
    trl_mean: float
    trl_se: float  # the standard error of TRL's seeds' gains: sample std / sqrt(seeds)
    trl_learns: bool  # trl_mean >= LEARNS
    bi_mean: float | None
    bi_holds: bool | None  # bi_mean >= trl_mean - MARGIN_SE * trl_se
    native_mean: float | None
    native_holds: bool | None  # |native_mean - bi_mean| <= MARGIN_SE * trl_se

    @property
    def margin(self) -> float:
        return MARGIN_SE * self.trl_se

    def lines(self) -> list[str]:
        yes = {True: "yes", False: "NO"}
        out = [
            f"TRL: mean gain {self.trl_mean:+.3f}, standard error of its {self.seeds} seeds' gains {self.trl_se:.3f}"
            f" (2 SE = {self.margin:.3f})",
            f"TRL learns (mean gain >= {LEARNS:+.2f}): {yes[self.trl_learns]}",
        ]
        if self.bi_mean is None:
            out.append("ours BI: not run")
        else:
            out.append(
                f"ours BI mean gain {self.bi_mean:+.3f} >= TRL's mean - 2 SE = {self.trl_mean - self.margin:+.3f}: "
                f"{yes[self.bi_holds]}"
            )
        if self.native_mean is None or self.bi_mean is None:
            out.append("ours native within 2 SE of ours BI: not run")
        else:
            out.append(
                f"ours native mean gain {self.native_mean:+.3f} within 2 SE ({self.margin:.3f}) of ours BI "
                f"{self.bi_mean:+.3f} (difference {self.native_mean - self.bi_mean:+.3f}): {yes[self.native_holds]}"
            )
        return out


def verdicts(gains: dict[str, list[float]]) -> Verdicts | None:
    """The verdicts on `gains` (variant -> gain per seed); None without TRL's gains on >= 2 seeds
    (no standard error)."""
    trl = gains.get("trl") or []
    if len(trl) < 2:
        return None
    mean = {variant: statistics.fmean(values) for variant, values in gains.items() if values}
    se = statistics.stdev(trl) / math.sqrt(len(trl))
    bi, native = mean.get("ours-bi"), mean.get("ours-native")
    return Verdicts(
        seeds=len(trl),
        trl_mean=mean["trl"],
        trl_se=se,
        trl_learns=mean["trl"] >= LEARNS,
        bi_mean=bi,
        bi_holds=None if bi is None else bi >= mean["trl"] - MARGIN_SE * se,
        native_mean=native,
        native_holds=None if native is None or bi is None else abs(native - bi) <= MARGIN_SE * se,
    )


def report(curves: dict[str, dict[int, list[float]]], header: str) -> tuple[str, list[str]]:
    """The Markdown table (gain per seed, mean and min per variant), the verdicts, what makes the
    comparison statistical and the remaining differences; and the verdict lines alone."""
    lines = [
        header,
        "",
        "| variant | seed | reward, first 10 steps | reward, last 10 steps | gain |",
        "|---|---:|---:|---:|---:|",
    ]
    summary, gains = [], {}
    for variant, seeds in curves.items():
        gains[variant] = []
        for seed, values in seeds.items():
            first, last, delta = gain(values)
            gains[variant].append(delta)
            lines.append(f"| {variant} | {seed} | {first:.3f} | {last:.3f} | {delta:+.3f} |")
        if gains[variant]:
            summary.append(
                f"{variant}: gain mean {statistics.fmean(gains[variant]):+.3f}, min {min(gains[variant]):+.3f}"
            )
    verdict = verdicts(gains)
    verdict_lines = verdict.lines() if verdict else ["no verdicts: they need TRL's gains on at least 2 seeds"]
    lines += ["", *summary, "", "Verdicts:", *(f"- {v}" for v in verdict_lines), "", STATISTICAL, ""]
    lines += ["Differences that remain by definition:", *(f"- {d}" for d in REMAINING)]
    return "\n".join(lines), verdict_lines


# ---------------------------------------------------------------------------------- the page
def rolling(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def page(curves: dict[str, dict[int, list[float]]], table: str, title: str, verdict_lines: list[str]) -> str:
    """A self-contained HTML page: the verdicts, one SVG of the rolling reward (mean over seeds
    with min-max band; the axis spans [0, 1] and any reward outside it), the table."""
    width, height, pad = 820, 420, 50
    steps = max(len(v) for seeds in curves.values() for v in seeds.values())
    values = [r for seeds in curves.values() for v in seeds.values() for r in v]
    low, high = min(0.0, *values), max(1.0, *values)
    x = lambda i: pad + (width - 2 * pad) * i / max(steps - 1, 1)  # noqa: E731
    y = lambda r: height - pad - (height - 2 * pad) * (r - low) / (high - low)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    for tick in (low + (high - low) * k / 4 for k in range(5)):
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{pad - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.2f}</text>')
    every = max(steps // 6, 1)
    for k in sorted({1, *range(every, steps + 1, every)}):  # step k is point k - 1
        parts.append(f'<text x="{x(k - 1):.1f}" y="{height - pad + 16}" text-anchor="middle">{k}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">RL step</text>')
    for n, (name, seeds) in enumerate(curves.items()):
        smooth = [rolling(v) for v in seeds.values()]
        length = min(len(v) for v in smooth)
        lo = [min(v[i] for v in smooth) for i in range(length)]
        hi = [max(v[i] for v in smooth) for i in range(length)]
        mean = [sum(v[i] for v in smooth) / len(smooth) for i in range(length)]
        band = [f"{x(i):.1f},{y(hi[i]):.1f}" for i in range(length)]
        band += [f"{x(i):.1f},{y(lo[i]):.1f}" for i in reversed(range(length))]
        color = COLORS.get(name, "#555")
        parts.append(f'<polygon points="{" ".join(band)}" fill="{color}" opacity="0.15"/>')
        line = " ".join(f"{x(i):.1f},{y(mean[i]):.1f}" for i in range(length))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        label = f"{name} ({len(smooth)} seeds)"
        parts.append(f'<text x="{pad + 10}" y="{pad + 16 * n}" fill="{color}">{html.escape(label)}</text>')
    parts.append("</svg>")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'><h1>{html.escape(title)}</h1>"
        f"<ul>{''.join(f'<li>{html.escape(v)}</li>' for v in verdict_lines)}</ul>"
        f"<p>{html.escape(STATISTICAL)}</p>"
        "<p>Mean reward per RL step, rolling mean over 10 steps; line: mean over seeds, band: min to max.</p>"
        f"{''.join(parts)}<pre style='white-space:pre-wrap'>{html.escape(table)}</pre></body></html>\n"
    )


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", help="the warm-up run every variant starts from")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rl", default="rl-tiny", help="RL recipe: a name or a TOML file (a user task's too)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default="runs/rl-vs-trl")
    parser.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.trl_worker is not None:
        trl_worker(opts.trl_worker)
        return 0
    os.chdir(ROOT)
    if not opts.init:
        parser.error("--init RUN is required")
    if not Path(opts.init).exists():
        parser.error(f"--init {opts.init}: no such run or HF directory")
    if opts.steps < 20:
        parser.error(f"--steps {opts.steps}: the gain compares the first and last 10 steps; use >= 20")
    from titan_audit.bench.trl_peer import trl_missing
    from titan_audit.rl.config import load_rl_config

    try:
        config = load_rl_config(opts.rl, [f"steps={opts.steps}"])
    except ValueError as error:
        parser.error(f"--rl {opts.rl}: {error}")
    variants = list(dict.fromkeys(opts.variants))
    if "trl" in variants and (reason := trl_missing()):
        log(f"skipped: trl ({reason})")
        variants.remove("trl")
    if "trl" in variants and (reason := check_trl_task(config)):
        parser.error(f"--rl {opts.rl}: {reason}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    made = {"init": opts.init, "rl": opts.rl, "steps": opts.steps}
    record = out / "comparison.json"
    if record.is_file() and json.loads(record.read_text()) != made:
        parser.error(
            f"--out {out}: its runs are of {record.read_text().strip()}, not {json.dumps(made)}; use another --out"
        )
    record.write_text(json.dumps(made) + "\n")
    init, hf = Path(opts.init), out / "init-hf"
    if "trl" in variants and not (hf / "config.json").is_file():
        run([*CLI, "export", str(init), "--out", str(hf), "--overwrite=delete"], out / "export.log")
    curves: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    for seed in opts.seeds:
        for variant in variants:
            run_dir = out / f"{variant}-s{seed}"
            read = trl_rewards if variant == "trl" else ours_rewards
            if read(run_dir, opts.steps) is None:
                if variant == "trl":
                    run_dir.mkdir(parents=True, exist_ok=True)
                    spec = {"rl": opts.rl, "seed": seed, "steps": opts.steps, "model": str(hf), "out": str(run_dir)}
                    (run_dir / "spec.json").write_text(json.dumps(spec))
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
                    env |= {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
                    command = [sys.executable, __file__, "--trl-worker", str(run_dir / "spec.json")]
                    run(command, out / f"{variant}-s{seed}.log", env)
                else:
                    command = [*CLI, "rl", "--config", opts.rl, "--init", str(init), "--steps", str(opts.steps)]
                    command += ["--out", str(run_dir), "--set", f"seed={seed}", "--overwrite=delete"]
                    if variant == "ours-native":
                        command += ["--set", "determinism.batch_invariant=false"]
                    run(command, out / f"{variant}-s{seed}.log")
            curves[variant][seed] = read(run_dir, opts.steps)
    task = config.task.name if config.task.prompts is None else f"user task {os.path.relpath(config.task.prompts)}"
    header = f"Start: `{init}`; RL `{opts.rl}` ({task}), {opts.steps} steps, seeds {opts.seeds}."
    table, verdict_lines = report(curves, header)
    (out / "table.md").write_text(table + "\n")
    title = f"GRPO learning: ours vs TRL ({opts.rl})"
    (out / "learning.html").write_text(page(curves, table, title, verdict_lines))
    print(table)
    log(f"wrote {out / 'table.md'} and {out / 'learning.html'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
