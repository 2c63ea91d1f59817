"""`titan-audit demo`: the project's main job, end to end on a CPU in about a minute.

Every stage checks a guarantee and says so; the demo fails (the CLI exits 1) if one does not hold.
1. The numerics fingerprint of this machine: what decides the bits here.
2. G1 run-to-run: `tiny-dense` trained twice for 8 steps on one rank gives identical audit logs
   (data, loss, gradients, parameters, optimizer state: every record's hash).
3. G3 elastic: the same run on 2 ranks (torchrun, gloo) is bitwise identical to the 1-rank run.
   Negative control: with determinism off (plain all_reduce) the 2-rank run differs, and
   `compare` names the first divergence.
4. G3/G5 elastic replay: the 2-rank run's step-4 checkpoint resumed on 1 rank replays steps 5-8
   bit for bit.
5. Golden check: a golden recorded from the 1-rank run passes, in exact mode, for the 2-rank run.
6. G2 batch invariance on the same decoder: token-by-token KV-cache decode gives the logits bits
   of one full forward with batch-invariant ops, and different bits with native ops (control).
RL and the zero-gap (G4) report join when rl/ lands.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import torch
from rich.console import Console

from titan_audit import batch_invariant, models
from titan_audit.audit import bitwise_equal, compare_runs
from titan_audit.deterministic import fingerprint as numerics_fingerprint
from titan_audit.golden import check_golden, record_golden
from titan_audit.trainer.config import load_config
from titan_audit.trainer.launch import launch
from titan_audit.trainer.replay import elastic_replay

RECIPE, STEPS, REPLAY_FROM = "tiny-dense", 8, 4


def default_out_dir() -> Path:
    return Path("runs") / dt.datetime.now(dt.timezone.utc).strftime("demo-%Y%m%dT%H%M%SZ")


def train_run(out: Path, nproc: int, overrides: tuple[str, ...] = ()) -> None:
    config = load_config(RECIPE, overrides=[f"steps={STEPS}", *overrides])
    rc = launch(config, out, nproc=nproc if nproc > 1 else None, quiet=True)
    if rc:
        raise RuntimeError(f"training into {out} failed with exit code {rc}")


@torch.no_grad()
def decode_matches_full_forward(bi: bool, prompt_len: int = 24, new_tokens: int = 8) -> bool:
    """Do cached token-by-token decode logits equal one full forward's, bit for bit?"""
    model = models.build(RECIPE, seed=0)
    tokens = torch.randint(model.config.vocab_size, (1, prompt_len + new_tokens),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    with batch_invariant.enabled(bi):
        full = model(tokens)
        cache = models.ContiguousKVCache(model.config, batch_size=1, max_len=prompt_len + new_tokens)
        steps = [model(tokens[:, :prompt_len], cache=cache)]
        for t in range(prompt_len, prompt_len + new_tokens):
            steps.append(model(tokens[:, t : t + 1], cache=cache))
    return bitwise_equal(torch.cat(steps, dim=1), full)


def _verdict(ok: bool, good: str, bad: str) -> str:
    return f"[green]{good}[/]" if ok else f"[red]{bad}[/]"


def run(out: Path | None = None, console: Console | None = None) -> bool:
    console = console or Console()
    out = out or default_out_dir()
    if out.exists():
        raise ValueError(f"{out}: already exists; the demo writes new runs only (pick another --out)")
    fp = numerics_fingerprint()
    console.rule("[bold]titan-audit demo")
    console.print(
        f"numerics: torch {fp.torch_version} on {fp.device_kind} ({fp.device_name}), ISA {fp.cpu_capability}, "
        f"BLAS {fp.blas}; runs go to {out}"
    )
    checks: list[bool] = []

    console.rule(f"G1 run-to-run: {RECIPE}, {STEPS} steps, twice on 1 rank")
    train_run(out / "w1", nproc=1)
    train_run(out / "w1-again", nproc=1)
    same = compare_runs(out / "w1", out / "w1-again")
    console.print(_verdict(same.identical, f"identical: {same.compared} audit records, all hashes equal",
                           f"DIFFERENT: {same.differing} records differ"))  # fmt: skip
    checks.append(same.identical)

    console.rule("G3 elastic: the same run on 2 ranks (torchrun, gloo)")
    train_run(out / "w2", nproc=2)
    elastic = compare_runs(out / "w1", out / "w2")
    console.print(_verdict(elastic.identical, f"W=2 == W=1: {elastic.compared} audit records, all hashes equal",
                           f"DIFFERENT: {elastic.differing} records differ"))  # fmt: skip
    train_run(out / "w2-nondeterministic", nproc=2, overrides=("determinism.enabled=false",))
    control = compare_runs(out / "w1", out / "w2-nondeterministic")
    if control.identical:
        console.print("[red]negative control: plain all_reduce gave the same bits; the check proves nothing here")
    else:
        first = control.first_divergence
        console.print(f"negative control, plain all_reduce at W=2: [yellow]differs[/], first at step {first['step']} "
                      f"phase {first['phase']} ({first['name']})")  # fmt: skip
    checks += [elastic.identical, not control.identical]

    console.rule(f"G3/G5 elastic replay: W=2 checkpoint of step {REPLAY_FROM} resumed on 1 rank")
    replayed, to_step = elastic_replay(out / "w2", REPLAY_FROM, out / "w2-replay-w1", nproc=1, quiet=True)
    console.print(_verdict(replayed.identical,
                           f"steps {REPLAY_FROM + 1}-{to_step} identical ({replayed.compared} records)",
                           f"DIFFERENT: {replayed.differing} records differ"))  # fmt: skip
    checks.append(replayed.identical)

    console.rule("golden check: record from the W=1 run, check the W=2 run")
    record_golden(out / "w1", out / "golden")
    golden = check_golden(out / "w2", out / "golden")
    console.print(_verdict(golden.passed and golden.mode == "exact", f"PASS in {golden.mode} mode",
                           f"FAIL ({golden.mode} mode)"))  # fmt: skip
    checks.append(golden.passed and golden.mode == "exact")

    console.rule(f"G2 batch invariance: KV-cache decode vs full forward ({RECIPE})")
    bi_equal, native_equal = decode_matches_full_forward(bi=True), decode_matches_full_forward(bi=False)
    console.print(
        _verdict(bi_equal, "batch-invariant ops: identical bits", "batch-invariant ops: DIFFERENT bits")
        + "; native ops (control): " + ("identical bits" if native_equal else "[yellow]different bits[/]")
    )
    checks.append(bi_equal)

    ok = all(checks)
    console.rule("[green]demo passed: every guarantee held" if ok else "[red]demo found a problem")
    console.print(f"inspect: titan-audit compare {out / 'w1'} {out / 'w2-nondeterministic'}")
    return ok
