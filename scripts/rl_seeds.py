#!/usr/bin/env python
"""Does the shipped RL recipe learn on every seed? Warm-up + GRPO per seed, then a markdown table.

    .venv/bin/python scripts/rl_seeds.py --warmup-seed 0       # docs/rl.md's table
    .venv/bin/python scripts/rl_seeds.py                       # whole-recipe seeds (warm-up too)
    .venv/bin/python scripts/rl_seeds.py --seeds 0 --steps 50  # a quick look

Seed s sets the RL run's seed (`titan-audit verify-onpolicy --config RL --init <warm-up> --set
seed=s`: the prompt sets and the sampling keys). Its warm-up (`titan-audit train --config WARMUP
--set seed=w --until UNTIL`: the model init, the data order and the held-out prompts of the stop
condition) has w = s by default, the whole recipe per seed, or one fixed w for every RL seed with
--warmup-seed w (one warm-up, then three RL runs). The warm-up stops at the skill level --until
(default: docs/rl.md's, mean reward 0.24 on held-out reversal-short prompts; `--until none`: the
recipe's step count). The corpus is fixed (`titan-audit data synth --seed 0`, docs/rl.md's
commands).

Per seed: the warm-up's stop step and its held-out reward there, the mean reward of the first 10
and the last 10 RL steps (metrics.parquet, `reward_mean`) and the gain. Prints the table (min and
mean gain below it) and writes it to OUT/table.md (OUT/table-wW.md with --warmup-seed W); exit
status 1 if any gain is below --min-gain, or any run shows a zero-gap failure (verify-onpolicy's
verdict). Runs already complete in OUT are reused, so a second call only prints the table (--fresh redoes them).
Progress goes to stderr; each command's full output to OUT/<run>.log (runs: OUT/warmup-sW,
OUT/rl-sS-wW).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from titan_audit.audit.run_metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "titan_audit.cli"]
DATA = "runs/rl-warmup-data"
UNTIL = "reward>=0.24,task=reversal-short,every=20"  # docs/rl.md's warm-up stop condition


def log(message: str) -> None:
    print(f"[rl_seeds {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def run(args: list[str], logfile: Path, every: int) -> int:
    """Run a titan-audit command; its output goes to `logfile`, every `every`-th step line (and
    the last lines on failure) to stderr."""
    log("$ titan-audit " + " ".join(args))
    t0 = time.perf_counter()
    step_line = re.compile(r"\bstep (\d+)/(\d+) ")
    tail: list[str] = []
    with open(logfile, "w") as sink:
        proc = subprocess.Popen(
            [*CLI, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            tail = (tail + [line.rstrip()])[-20:]
            match = step_line.search(line)
            if match and (int(match.group(1)) % every == 0 or match.group(1) == match.group(2)):
                log(f"  {line.strip()}  [{time.perf_counter() - t0:.0f} s]")
        rc = proc.wait()
    log(f"  exit {rc} after {time.perf_counter() - t0:.0f} s (log: {logfile})")
    if rc not in (0, 1):
        print("\n".join(tail), file=sys.stderr)
    return rc


def complete(run_dir: Path, steps: int) -> bool:
    """The run reached `steps`, or its stop condition (`until_stop`) ended it."""
    rows = metrics(run_dir)
    if not rows or not (run_dir / "checkpoints").is_dir():
        return False
    return rows[-1]["step"] >= steps or bool(rows[-1].get("until_stop"))


def stop_point(run_dir: Path) -> tuple[int, float | None]:
    """The warm-up's last step and its last held-out evaluation (None without --until)."""
    rows = metrics(run_dir)
    values = [r["until_value"] for r in rows if r.get("until_value") is not None]
    return rows[-1]["step"], (values[-1] if values else None)


def warmup_steps(config: str) -> int:
    from titan_audit.trainer.config import load_config

    return load_config(config).steps


def ensure_data() -> None:
    store = Path(DATA) / "reversal.zarr"
    if store.exists():
        return
    log(f"making the warm-up corpus in {DATA}/")
    for args in (
        ["data", "synth", "--task", "reversal", "--num", "40000", f"{DATA}/reversal.parquet", "--overwrite"],
        ["data", "prepare", f"{DATA}/reversal.parquet", "--out", f"{DATA}/reversal.zarr"],
    ):
        subprocess.run([*CLI, *args], cwd=ROOT, check=True, capture_output=True)


def metrics(run_dir: Path) -> list[dict]:
    table = read_metrics(run_dir)
    return [] if table is None else sorted(table.to_pylist(), key=lambda r: r["step"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup", default="recipes/rl-warmup.toml", help="train recipe of the warm-up")
    parser.add_argument("--warmup-seed", type=int, default=None, help="one warm-up seed for every RL seed")
    parser.add_argument("--until", default=UNTIL, help="the warm-up's stop condition (`train --until`; none: off)")
    parser.add_argument("--rl", default="rl-tiny", help="RL recipe (a name or a TOML file)")
    parser.add_argument("--steps", type=int, default=300, help="RL steps per seed")
    parser.add_argument("--out", default="runs/rl-seeds", help="where the runs go")
    parser.add_argument("--min-gain", type=float, default=0.15, help="exit 1 if a seed gains less")
    parser.add_argument("--set", dest="rl_set", action="append", default=[], help="extra RL override KEY=VALUE")
    parser.add_argument("--warmup-set", action="append", default=[], help="extra warm-up override KEY=VALUE")
    parser.add_argument("--fresh", action="store_true", help="redo runs that are already complete")
    parser.add_argument("--every", type=int, default=50, help="print every N-th step line")
    opts = parser.parse_args(argv)

    os.chdir(ROOT)  # paths are relative to the repository root, where the commands run
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = cpu_model()
    log(f"machine: {machine}; seeds {opts.seeds}; warm-up {opts.warmup}; RL {opts.rl}, {opts.steps} steps")
    ensure_data()
    w_steps = warmup_steps(opts.warmup)
    results, failures = [], []
    warmed: set[Path] = set()
    for seed in opts.seeds:
        w_seed = seed if opts.warmup_seed is None else opts.warmup_seed
        warm = out / f"warmup-s{w_seed}"
        if warm in warmed:
            pass
        elif opts.fresh or not complete(warm, w_steps):
            args = ["train", "--config", opts.warmup, "--out", str(warm), "--set", f"seed={w_seed}"]
            args += [] if opts.until == "none" else ["--until", opts.until]
            args += [a for s in opts.warmup_set for a in ("--set", s)]
            if warm.exists():
                args.append("--overwrite")
            if run(args, out / f"warmup-s{w_seed}.log", opts.every):
                failures.append(f"seed {seed}: warm-up (seed {w_seed}) failed")
                continue
        else:
            log(f"warm-up {warm} already complete")
        warmed.add(warm)
        rl = out / f"rl-s{seed}-w{w_seed}"
        if opts.fresh or not complete(rl, opts.steps):
            args = ["verify-onpolicy", "--config", opts.rl, "--init", str(warm), "--steps", str(opts.steps)]
            args += ["--out", str(rl), "--set", f"seed={seed}", *[a for s in opts.rl_set for a in ("--set", s)]]
            if rl.exists():
                args.append("--overwrite")
            rc = run(args, out / f"rl-s{seed}-w{w_seed}.log", opts.every)
            if rc == 1:
                failures.append(f"seed {seed}: verify-onpolicy found a gap")
            elif rc:
                failures.append(f"seed {seed}: RL failed (exit {rc})")
                continue
        else:
            log(f"seed {seed}: RL {rl} already complete")
        rows = metrics(rl)[: opts.steps]
        head, tail = [r["reward_mean"] for r in rows[:10]], [r["reward_mean"] for r in rows[-10:]]
        first, last = sum(head) / len(head), sum(tail) / len(tail)
        seconds = sum(r["seconds"] for r in rows)
        tokens = sum(r.get("gap_tokens") or 0 for r in rows)
        differing = sum(r.get("gap_tokens_differing") or 0 for r in rows)
        w_step, w_value = stop_point(warm)
        results.append((seed, w_seed, w_step, w_value, first, last, last - first, seconds, tokens, differing))
        log(
            f"seed {seed}: reward {first:.3f} -> {last:.3f} ({last - first:+.3f}), {seconds:.0f} s of RL step time, "
            f"{differing} of {tokens} sampled tokens with a log-prob gap"
        )

    lines = [
        f"Machine: {machine}; warm-up `{opts.warmup}`"
        + ("" if opts.until == "none" else f" until `{opts.until}`")
        + f", RL `{opts.rl}`, {opts.steps} RL steps per seed.",
        "",
        "| RL seed | warm-up seed | warm-up steps | held-out reward | reward, first 10 steps "
        "| reward, last 10 steps | gain | tokens recomputed / with a gap | RL step time |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {s} | {w} | {ws} | {'-' if wv is None else f'{wv:.3f}'} | {a:.3f} | {b:.3f} | {g:+.3f} "
        f"| {n:,} / {d} | {t:.0f} s |"
        for s, w, ws, wv, a, b, g, t, n, d in results
    ]
    if results:
        gains = [r[6] for r in results]
        lines += ["", f"Gain over {len(gains)} seeds: min {min(gains):+.3f}, mean {sum(gains) / len(gains):+.3f}."]
        failures += [f"seed {r[0]}: gain {r[6]:+.3f} < {opts.min_gain:+.3f}" for r in results if r[6] < opts.min_gain]
    table = "\n".join(lines)
    name = "table.md" if opts.warmup_seed is None else f"table-w{opts.warmup_seed}.md"
    (out / name).write_text(table + "\n")
    print(table)
    for failure in failures:
        log(f"FAIL {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
