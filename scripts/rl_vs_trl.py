#!/usr/bin/env python
"""Does our GRPO learn like TRL's? The same start, prompts, reward and hyperparameters, side by side.

    .venv/bin/python scripts/rl_vs_trl.py --init runs/rl-seeds/warmup-s0                # 5 seeds, 300 steps
    .venv/bin/python scripts/rl_vs_trl.py --init runs/rl-seeds/warmup-s0 --steps 100 --seeds 0 1

From one warm-up run (`--init`, e.g. the README's `recipes/rl-warmup.toml` run), for each seed s:
- ours, BI mode: `titan-audit rl --config RL --init INIT --steps N --set seed=s` (OUT/ours-bi-sS);
- ours, native ops: the same with `determinism.batch_invariant=false` (OUT/ours-native-sS);
- TRL: GRPOTrainer (`trl`, the `peers` extra) started from INIT exported as an HF directory
  (`titan-audit export`, OUT/init-hf), on the prompts of our run's steps 1..N in order
  (`rl.tasks.prompt_set(task, s, step, P)`, `shuffle_dataset=False`) with our byte tokenizer's ids
  (bench/trl_peer.py `byte_tokenizer`), scored by our task's reward (`rl.tasks.score` of the text
  before EOS), G generations per prompt, P prompts per optimizer step (gradient accumulation),
  our temperature, max_new_tokens, lr, betas, eps, weight decay, grad clip, clip epsilon and KL
  coefficient, a constant schedule, loss_type "dapo" (token-level over the step's tokens, as
  ours), seed s (OUT/trl-sS/rewards.json: the mean reward of each step, from TRL's log).
Differences that remain by definition: advantages use our population std + 1e-6 (rl/loss.py) vs
TRL's Bessel-corrected nanstd + 1e-4; TRL passes a reward function completion_ids with the first
EOS, ours without it (rl/user_task.py; the reward here reads the text before EOS, the same in
both; both train on the EOS token); TRL samples from torch's generator, not our keyed uniforms, with
HF transformers' kernels, and steps torch's AdamW, not our portable one.

Per seed and variant: mean reward of the first 10 and last 10 steps and the gain; per variant
the mean and min gain. Writes OUT/table.md and OUT/learning.html (one self-contained page: the
reward per step, rolling mean over 10 steps, mean over seeds with the min-max band). Runs already
complete in OUT are reused. Every command's output goes to OUT/<run>.log.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "titan_audit.cli"]
VARIANTS = ("ours-bi", "ours-native", "trl")
COLORS = {"ours-bi": "#1f77b4", "ours-native": "#2ca02c", "trl": "#d62728"}


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
def trl_worker(spec_path: Path) -> None:
    """One TRL run (a subprocess: its threads and imports stay its own); see the module docstring."""
    spec = json.loads(spec_path.read_text())
    import torch

    torch.set_num_threads(1)
    sys.modules["vllm"] = None  # use_vllm=False: trl then never imports vLLM
    import datasets
    import transformers
    import trl

    from titan_audit.bench.trl_peer import byte_tokenizer, grpo_args, matched_rows, task_reward
    from titan_audit.rl.config import load_rl_config

    config = load_rl_config(spec["rl"], [f"seed={spec['seed']}", f"steps={spec['steps']}"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = byte_tokenizer()
    rows = matched_rows(config, config.steps, tokenizer)
    # loss_type "dapo": the loss over the step's tokens, as ours; a reward logged every step
    args = grpo_args(
        trl, config, spec["out"], config.steps, loss_type="dapo", logging_strategy="steps", logging_steps=1
    )
    rewards: list[float] = []

    class Rewards(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Rewards()],
    )
    trainer.train()
    assert len(rewards) == config.steps, f"TRL logged {len(rewards)} step rewards of {config.steps}"
    Path(spec["out"], "rewards.json").write_text(json.dumps(rewards))


# ---------------------------------------------------------------------------------- the page
def rolling(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def page(curves: dict[str, dict[int, list[float]]], table: str, title: str) -> str:
    """A self-contained HTML page: one SVG of the rolling reward, mean over seeds with min-max band."""
    width, height, pad = 820, 420, 50
    steps = max(len(v) for seeds in curves.values() for v in seeds.values())
    x = lambda i: pad + (width - 2 * pad) * i / max(steps - 1, 1)  # noqa: E731
    y = lambda r: height - pad - (height - 2 * pad) * r  # noqa: E731 - rewards lie in [0, 1]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
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
        "<p>Mean reward per RL step, rolling mean over 10 steps; line: mean over seeds, band: min to max.</p>"
        f"{''.join(parts)}<pre>{html.escape(table)}</pre></body></html>\n"
    )


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", help="the warm-up run every variant starts from")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rl", default="rl-tiny", help="RL recipe (a name or a TOML file)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default="runs/rl-vs-trl")
    parser.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.trl_worker is not None:
        trl_worker(opts.trl_worker)
        return 0
    if not opts.init:
        parser.error("--init RUN is required")
    os.chdir(ROOT)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    init, hf = Path(opts.init), out / "init-hf"
    if "trl" in opts.variants and not (hf / "config.json").is_file():
        run([*CLI, "export", str(init), "--out", str(hf), "--overwrite=delete"], out / "export.log")
    curves: dict[str, dict[int, list[float]]] = {v: {} for v in opts.variants}
    for seed in opts.seeds:
        for variant in opts.variants:
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
    lines = [
        f"Start: `{init}`; RL `{opts.rl}`, {opts.steps} steps, seeds {opts.seeds}.",
        "",
        "| variant | seed | reward, first 10 steps | reward, last 10 steps | gain |",
        "|---|---:|---:|---:|---:|",
    ]
    summary = []
    for variant, seeds in curves.items():
        gains = []
        for seed, values in seeds.items():
            first, last = sum(values[:10]) / 10, sum(values[-10:]) / 10
            gains.append(last - first)
            lines.append(f"| {variant} | {seed} | {first:.3f} | {last:.3f} | {last - first:+.3f} |")
        summary.append(f"{variant}: gain mean {sum(gains) / len(gains):+.3f}, min {min(gains):+.3f}")
    table = "\n".join([*lines, "", *summary])
    (out / "table.md").write_text(table + "\n")
    (out / "learning.html").write_text(page(curves, table, f"GRPO learning: ours vs TRL ({opts.rl})"))
    print(table)
    log(f"wrote {out / 'table.md'} and {out / 'learning.html'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
