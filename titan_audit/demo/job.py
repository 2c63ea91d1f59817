"""`titan-audit demo`: every guarantee proven on this machine, end to end, then a verdict table.

    result = run(Path("runs/demo"), quick=False)   # result.passed False: a guarantee failed (the CLI exits 1)

Stages (S steps of `tiny-dense` on the built-in synthetic corpus, full audit: data, forward and
backward of every module, loss, reduced gradients, optimizer state, parameters; a checkpoint
every S/2 steps; S = 8, or 4 with --quick):
- G3 elastic: the run on 2 ranks (torchrun, gloo) and on 1 rank compare identical record for
  record; the 2-rank run's mid-run checkpoint replayed on 1 rank gives the same later steps.
  Negative control (not with --quick): the 2-rank run with determinism off (plain all_reduce)
  differs, and the report maps where.
- G5 kill and resume: the 1-rank run started in a child process is sent SIGKILL right after its
  mid-run checkpoint appears, resumed with --resume, and compared with the uninterrupted run
  (audit records and the final checkpoint's tensor hashes).
- G4 zero gap: GRPO (`rl-tiny`, small) from the trained run with `verify`: every sampled token's
  generator log-prob equals the trainer's recomputation bitwise, with the built-in generator and,
  when `titan_audit.rl.vllm` says it is available, vLLM (not with --quick: its engine start-up
  makes the stage ~28 s on 2 cores; the row says so). Negative control: the constructed control
  run (`control = "generator-weight-ulp"`, rl/control.py: the generator is sent the trainer's
  weights with one element one ulp off) must show a gap. Not with --quick, the same run with
  native ops is reported in that row (not counted: whether native ops leave a gap depends on the
  CPU's libraries).
- G2 batch invariance: spot-checks of attention (batch, decode, chunked prefill), matmul,
  log_softmax and rms_norm at several head dims including 128, and the model's KV-cache decode;
  native ops reported (not counted). Negative control: the model's KV-cache decode summed in the
  other gemm order must differ from the full forward.
- G1 run to run: the committed goldens (titan_audit/goldens/tiny-dense and tiny-dense-bi, shipped
  as package data; recorded earlier, elsewhere) check against runs made now: exact when the
  numerics fingerprints are compatible (the BI golden must be exact on any CPU). Negative control:
  a run with another seed fails the BI golden.
Then OUT/demo.json (the verdicts, runs and timings) and the run report OUT/reports/report.html
and report.md (titan_audit.report). A stage that fails is a FAIL row with its reason (and log);
the stages that need it are FAIL rows too ("needs ..."); nothing is skipped silently.

Subprocess stages write their output to OUT/logs/<stage>.log (passed on line by line with
`verbose`: the CLI's -v streams it); in-process stages run quiet unless `verbose`.

No terminal presentation here: the demo reports what happens to a `Listener` (plain callbacks: a
stage starts, a step is done, a verdict row, a message, a line of a stage's output) and returns a
`Result` (the verdict rows, timings, the report's paths). The default `Listener` logs through
`titan_audit.log` (INFO: stages, rows, messages; DEBUG: stage output); `titan_audit.cli.demo_view`
draws them in the terminal (progress bar, verdict table).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_json_atomic
from titan_audit.goldens import GOLDENS_DIR as GOLDEN_DIR
from titan_audit.log import get_logger

log = get_logger(__name__)

RECIPE, RL_RECIPE = "tiny-dense", "rl-tiny"
DEMO_FILE = "demo.json"
NEEDS_W2 = ("elastic", "control_w2")  # the stages that wait for the background 2-rank run


def default_out_dir() -> Path:
    return Path("runs") / dt.datetime.now(dt.UTC).strftime("demo-%Y%m%dT%H%M%SZ")


@dataclass
class Plan:
    quick: bool
    steps: int
    head_dims: tuple[int, ...]
    rl_steps: int
    rl_overrides: tuple[str, ...]
    controls: bool  # not with --quick: the G3 control (a torchrun start) and the reported native-ops RL run

    @property
    def checkpoint_step(self) -> int:
        return self.steps // 2

    @classmethod
    def make(cls, quick: bool) -> Plan:
        rl = (
            "task.prompts_per_step=4",
            "task.samples_per_prompt=4",
            "sampling.max_new_tokens=8",
            "checkpoint.interval=0",
        )
        if quick:
            return cls(True, 4, (64, 128), 2, rl, controls=False)
        return cls(False, 8, (64, 96, 128, 256), 4, rl, controls=True)

    def train_overrides(self) -> list[str]:
        return [f"steps={self.steps}", "audit.level=full", f"checkpoint.interval={self.checkpoint_step}"]


@dataclass
class Row:
    guarantee: str
    checked: str
    result: str  # PASS | FAIL | SKIP
    detail: str = ""
    evidence: str = ""


class Listener:
    """What the demo reports as it runs; subclass it and override what you show. This default logs
    through `titan_audit.log`. Calls come from the main thread and from the thread of the 2-rank
    run that runs in the background (its stage, rows, messages and output lines)."""

    def on_start(self, out: Path, quick: bool, numerics: str, steps: int) -> None:
        """The demo starts writing into `out`; `steps` calls of `on_done` will follow (the stages, then the report)."""
        log.info("titan-audit demo%s: %s; runs go to %s", " --quick" if quick else "", numerics, out)

    def on_stage(self, name: str, title: str, background: bool = False) -> None:
        """Stage `name` starts (`title`: what it does; `background`: it runs alongside the next ones)."""
        log.info("%s%s", title, " (in the background)" if background else "")

    def on_status(self, text: str) -> None:
        """What the demo is doing between stages: "waiting for the 2-rank run", "writing the report"."""
        log.debug("%s", text)

    def on_done(self, name: str, seconds: float) -> None:
        """One of the `steps` is done: a stage (failed or not; a failure is a FAIL row), or "report"."""
        log.debug("%s done in %.1f s", name, seconds)

    def on_row(self, row: Row) -> None:
        """A verdict."""
        log.info("  %s %s: %s%s", row.result, row.guarantee, row.checked, f" ({row.detail})" if row.detail else "")

    def on_message(self, text: str) -> None:
        """A line about what a stage did (or, with `verbose`, the traceback of a stage that failed)."""
        log.info("%s", text)

    def on_output(self, stage: str, line: str) -> None:
        """A line (no newline) of a subprocess stage's output; only with `verbose` (it is in OUT/logs/ always)."""
        log.debug("%s> %s", stage, line)


@dataclass
class Result:
    """What `run` returns: the verdicts in table order (controls after their checks), the stages'
    timings, the report's paths (None if writing it failed: then a FAIL row says why)."""

    out: Path
    quick: bool
    passed: bool
    rows: list[Row]
    seconds: float
    numerics: str
    stages: list[dict[str, Any]]
    report: dict[str, str] | None

    def __bool__(self) -> bool:  # `if not run(...)` reads as it did when run returned a bool
        return self.passed


@dataclass
class Demo:
    out: Path
    plan: Plan
    verbose: bool
    listener: Listener = field(default_factory=Listener)
    rows: list[Row] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # stage -> why
    extra: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- helpers
    def path(self, role: str, name: str) -> Path:
        self.runs[role] = name
        return self.out / name

    def say(self, text: str) -> None:
        self.listener.on_message(text)

    def row(self, guarantee: str, checked: str, ok: bool | None, detail: str = "", evidence: str | Path = "") -> None:
        result = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        row = Row(guarantee, checked, result, detail, str(evidence))
        self.rows.append(row)
        self.listener.on_row(row)

    def needs(self, *stages: str) -> str | None:
        missing = [s for s in stages if s in self.failed]
        return f"needs {', '.join(missing)}, which failed" if missing else None

    def run_logged(
        self,
        name: str,
        command: list[str],
        env: dict[str, str] | None = None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int:
        """Run `command`, its output to OUT/logs/NAME.log (and, with `verbose`, to `on_output`); its exit code."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as sink:
            sink.write("$ " + " ".join(command) + "\n")
            sink.flush()
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
            )
            # same process group: Ctrl-C in the terminal reaches the child (torchrun passes it on)

            def pump() -> None:
                for line in proc.stdout:  # type: ignore[union-attr]
                    sink.write(line)
                    if self.verbose:
                        self.listener.on_output(name, line.rstrip())

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            if on_start is not None:
                on_start(proc)
            rc = proc.wait()
            reader.join(timeout=10)
        return rc

    def train_subprocess(
        self,
        name: str,
        out: Path,
        overrides: list[str],
        nproc: int | None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int:
        """`titan-audit train --config RECIPE --out OUT [--nproc N] --set ...` as a child process
        (the user's own command: its checks, run lock and launcher), output to OUT/logs/NAME.log."""
        command = [
            sys.executable,
            "-m",
            "titan_audit.cli",
            "train",
            "--config",
            RECIPE,
            "--out",
            str(out),
            *(["--nproc", str(nproc)] if nproc else []),
            *[a for o in overrides for a in ("--set", o)],
        ]
        return self.run_logged(name, command, on_start=on_start)

    def train_here(self, out: Path, overrides: list[str], resume: bool = False) -> None:
        from titan_audit.trainer.config import load_config
        from titan_audit.trainer.launch import launch
        from titan_audit.trainer.train import check_run

        config = load_config(RECIPE, overrides)
        check_run(config, out, resume=resume, overwrite=False, world_size=1)
        rc = launch(config, out, nproc=None, resume=resume, quiet=not self.verbose)
        if rc:
            raise RuntimeError(f"training into {out} exited {rc}")

    def stage(
        self, name: str, title: str, fn: Callable[[], None], log: str | None = None, background: bool = False
    ) -> None:
        self.listener.on_stage(name, title, background)
        start = time.perf_counter()
        try:
            fn()
        except Exception as error:  # a failed stage is a FAIL row, the demo goes on
            reason = f"{type(error).__name__}: {error}"
            self.failed[name] = reason
            self.row(
                title.split(":")[0],
                f"stage {name}",
                False,
                reason[:300],
                self.out / "logs" / f"{log}.log" if log else "",
            )
            if self.verbose:
                import traceback

                self.say(traceback.format_exc())
        seconds = time.perf_counter() - start
        self.stages.append({"name": name, "seconds": seconds, "log": log})
        self.listener.on_done(name, seconds)

    # ---------------------------------------------------------------- stages
    def train_w2(self) -> None:
        out = self.path("train_w2", "train-w2")
        rc = self.train_subprocess("train-w2", out, self.plan.train_overrides(), nproc=2)
        if rc:
            raise RuntimeError(f"torchrun exited {rc}; see {self.out / 'logs' / 'train-w2.log'}")
        self.say(f"  trained {RECIPE} for {self.plan.steps} steps on 2 ranks (full audit) -> {out}")

    def train_w1(self) -> None:
        out = self.path("train_w1", "train-w1")
        self.train_here(out, self.plan.train_overrides())
        self.say(f"  trained the same run on 1 rank -> {out}")

    def elastic(self) -> None:
        from titan_audit.audit import compare_runs
        from titan_audit.trainer.replay import elastic_replay

        why = self.needs("train_w1", "train_w2")
        w1, w2 = self.out / "train-w1", self.out / "train-w2"
        if why:
            self.row("G3 elastic", "W=2 run == W=1 run", False, why)
        else:
            same = compare_runs(w2, w1)
            self.row(
                "G3 elastic",
                f"{RECIPE} {self.plan.steps} steps, W=2 == W=1, every audit record",
                same.identical,
                f"{same.compared} records compared, {same.differing} differ, "
                f"{same.only_in_a + same.only_in_b} in one run only",
                f"titan-audit compare {w2} {w1}",
            )
        why = self.needs("train_w2")
        k = self.plan.checkpoint_step
        if why:
            self.row("G3 elastic", "replay of a mid-run checkpoint at another W", False, why)
            return
        replay = self.path("replay_w1", "replay-w1")
        result, to_step = elastic_replay(w2, k, replay, nproc=1, quiet=not self.verbose)
        self.row(
            "G3 elastic",
            f"W=2 checkpoint of step {k} replayed on W=1: steps {k + 1}-{to_step}",
            result.identical,
            f"{result.compared} records compared, {result.differing} differ",
            replay,
        )

    def control_w2(self) -> None:
        from titan_audit.audit import compare_runs

        out = self.path("control_w2", "control-w2-nondeterministic")
        rc = self.train_subprocess(
            "control-w2", out, [*self.plan.train_overrides(), "determinism.enabled=false"], nproc=2
        )
        if rc:
            raise RuntimeError(f"torchrun exited {rc}; see {self.out / 'logs' / 'control-w2.log'}")
        why = self.needs("train_w1")
        if why:
            self.row("G3 control", "plain all_reduce at W=2 differs", False, why)
            return
        control = compare_runs(self.out / "train-w1", out)
        fd = control.first_divergence
        detail = (
            "identical: the check proves nothing here"
            if fd is None
            else f"differs, first at step {fd['step']} phase {fd['phase']} ({fd['name']}); "
            f"{control.differing} records differ"
        )
        self.row(
            "G3 control",
            "determinism off (plain all_reduce) at W=2 vs W=1 must differ",
            fd is not None,
            detail,
            f"titan-audit compare {self.out / 'train-w1'} {out}",
        )
        self.extra.setdefault("divergence", []).append(
            {"a": "train-w1", "b": out.name, "label": "W=1 vs W=2 with determinism off (plain all_reduce)"}
        )

    def kill_resume(self) -> None:
        from titan_audit.audit import compare_runs
        from titan_audit.trainer.checkpoint import Checkpointer

        out = self.path("kill_resume", "kill-resume-w1")
        k, steps = self.plan.checkpoint_step, self.plan.steps
        kill: dict[str, Any] = {"checkpoint_step": k}

        started = time.perf_counter()

        def killer(proc: subprocess.Popen) -> None:
            target = Checkpointer(out).path(k)
            while proc.poll() is None and not target.is_dir():
                time.sleep(0.01)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kill.update(pid=proc.pid, after_s=time.perf_counter() - started)

        rc = self.train_subprocess("kill-resume-w1", out, self.plan.train_overrides(), nproc=None, on_start=killer)
        kill["returncode"] = rc
        self.extra["kill"] = kill
        if rc != -signal.SIGKILL:
            raise RuntimeError(
                f"the run was to be killed after its step-{k} checkpoint but exited {rc} "
                f"(see {self.out / 'logs' / 'kill-resume-w1.log'})"
            )
        done = Checkpointer(out).steps()
        self.say(f"  SIGKILL to pid {kill['pid']} once checkpoint {k} was on disk (checkpoints left: {done}); resuming")
        self.train_here(out, self.plan.train_overrides(), resume=True)
        why = self.needs("train_w1")
        if why:
            self.row("G5 kill -9 + resume", "resumed run == uninterrupted run", False, why)
            return
        ref = self.out / "train-w1"
        same = compare_runs(ref, out)
        hashes = [json.loads((Checkpointer(r).path(steps) / "hashes.json").read_text())["tensors"] for r in (ref, out)]
        ok = same.identical and hashes[0] == hashes[1]
        self.row(
            "G5 kill -9 + resume",
            f"SIGKILL after the step-{k} checkpoint, --resume, == uninterrupted run",
            ok,
            f"{same.compared} records compared, {same.differing} differ; step-{steps} checkpoint hashes "
            f"{'equal' if hashes[0] == hashes[1] else 'DIFFER'} ({len(hashes[0])} tensors)",
            f"titan-audit compare {ref} {out}",
        )

    def _rl(self, role: str, name: str, extra: list[str]) -> dict[str, Any]:
        from titan_audit.rl.launch import start_rl
        from titan_audit.rl.report import onpolicy_summary

        out = self.path(role, name)
        init = self.out / "train-w1" if "train_w1" not in self.failed else None
        rc = start_rl(
            RL_RECIPE,
            out,
            init=None if init is None else str(init),
            nproc=None,
            steps=self.plan.rl_steps,
            resume=False,
            overwrite=False,
            overrides=[*self.plan.rl_overrides, "verify=true", *extra],
            quiet=not self.verbose,
        )
        if rc:
            raise RuntimeError(f"RL into {out} exited {rc}")
        return onpolicy_summary(out)

    def zero_gap(self) -> None:
        from titan_audit.rl.control import CONFIG_KEY
        from titan_audit.rl.report import control_shows_gap
        from titan_audit.rl.verify import CONTROL

        s = self._rl("rl_builtin", "rl-builtin", [])
        self.row(
            "G4 zero gap",
            f"built-in generator, {RL_RECIPE} {s['steps']} steps from the trained run",
            s["zero_gap"],
            f"{s['tokens_compared']} sampled tokens, {s['tokens_differing']} with any bit difference",
            self.out / "rl-builtin" / "reports",
        )
        control = self._rl("rl_control", "rl-control", [f"{CONFIG_KEY}={CONTROL}"])
        shows = control_shows_gap(control)
        detail = (
            f"{control['tokens_differing']} of {control['tokens_compared']} tokens differ, on "
            f"{control['steps_with_gap']} of {control['steps']} steps (max |diff| {control['max_abs_diff']:.3g})"
            if shows
            else f"none of {control['tokens_compared']} tokens differs: the zero-gap check proves nothing here"
        )
        divergence = [("rl-control", "RL with the generator's weights exact vs one ulp off", False)]
        if self.plan.controls:  # not with --quick: native ops, reported only
            native = self._rl("rl_native", "rl-native", ["determinism.batch_invariant=false"])
            detail += (
                f"; native ops (reported, not counted): {native['tokens_differing']} of "
                f"{native['tokens_compared']} tokens differ"
            )
            divergence.append(("rl-native", "RL with batch-invariant ops vs native ops", True))
        self.row(
            "G4 control",
            "generator sent the trainer's weights with one element one ulp off must show a gap",
            shows,
            detail,
            self.out / "rl-control",
        )
        for name, label, reported in divergence:
            pair = {"a": "rl-builtin", "b": name, "label": label, **({"reported": True} if reported else {})}
            self.extra.setdefault("divergence", []).append(pair)

    def zero_gap_vllm(self) -> None:
        if self.plan.quick:
            ok, reason = vllm_status()
            self.row(
                "G4 zero gap",
                "vLLM generator",
                None,
                "skipped in --quick (the vLLM stage took 28-29 s on 2 cores, mostly engine start-up); "
                + ("the full demo runs it" if ok else reason.removeprefix("skipped: ")),
            )
            return
        if self.verbose:  # titan_audit.rl.vllm keeps vLLM's log at ERROR unless this is set first
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        ok, reason = vllm_status()
        if not ok:
            self.row("G4 zero gap", "vLLM generator", None, reason)
            return
        s = self._rl("rl_vllm", "rl-vllm", ["generator=vllm"])
        self.row(
            "G4 zero gap",
            f"vLLM generator, {RL_RECIPE} {s['steps']} steps",
            s["zero_gap"],
            f"{s['tokens_compared']} sampled tokens, {s['tokens_differing']} with any bit difference",
            self.out / "rl-vllm" / "reports",
        )

    def spot_checks(self) -> None:
        from titan_audit.batch_invariant import GEMM_ORDERS, current_gemm_order
        from titan_audit.demo.spot_checks import MODEL, decode_matches_full_forward, run_spot_checks

        checks = run_spot_checks(self.plan.head_dims)
        self.extra["spot_checks"] = [c.to_dict() for c in checks]
        bad = [c for c in checks if not c.passed]
        native = sum(c.native == "differs" for c in checks)
        self.row(
            "G2 batch invariance",
            f"{len(checks)} spot-checks: attention (batch, decode, chunked), matmul, log_softmax, "
            f"rms_norm at head dims {', '.join(map(str, self.plan.head_dims))}; model KV decode",
            not bad,
            (
                f"all identical; native ops differ in {native} of {len(checks)} (reported, not counted)"
                if not bad
                else f"DIFFERENT: {'; '.join(c.check + ' ' + c.shape for c in bad[:3])}"
            ),
            "report: Batch invariance spot-checks",
        )
        order = current_gemm_order()
        other = next(o for o in GEMM_ORDERS if o != order)
        differs = not decode_matches_full_forward(True, decode_gemm_order=other)
        self.row(
            "G2 control",
            f"model {MODEL} KV-cache decode in gemm order {other} vs the full forward in {order} must differ",
            differs,
            "differs" if differs else "identical: the decode check proves nothing here",
            "report: Batch invariance spot-checks",
        )

    def goldens(self) -> None:
        from titan_audit.golden import check_golden

        if not (GOLDEN_DIR / "tiny-dense-bi" / "golden.json").is_file():
            raise RuntimeError(
                f"{GOLDEN_DIR}: the committed goldens are not there (package data of titan-audit: reinstall it)"
            )
        results = self.extra.setdefault("goldens", [])

        def check(golden: str, run: Path, require_exact: bool, control: bool = False):
            r = check_golden(run, GOLDEN_DIR / golden, require_exact=require_exact)
            results.append(
                {
                    "golden": str(GOLDEN_DIR / golden),
                    "run": str(run),
                    "mode": r.mode,
                    "result": ("PASS" if r.passed else "FAIL") + (" (the control: it must fail)" if control else ""),
                    "records": None if r.compare is None else r.compare.compared,
                    "metric_points": r.metric_points,
                    "notes": [
                        *r.failures,
                        *r.notes,
                        *(["config: " + "; ".join(r.config_differences)] if r.config_differences else []),
                    ],
                }
            )
            return r

        bi_run = self.path("golden_bi", "golden-bi-w1")
        self.train_here(bi_run, ["steps=4", "determinism.batch_invariant=true"])
        r = check("tiny-dense-bi", bi_run, True)
        self.row(
            "G1 run to run",
            "committed golden tiny-dense-bi (BI mode) vs a run made now, exact on any CPU",
            r.passed and r.mode == "exact",
            f"{r.mode} mode; "
            + (
                r.failures[0]
                if r.failures
                else f"{r.compare.compared if r.compare else 0} records, {r.metric_points} metric values bitwise equal"
            ),
            f"titan-audit golden check {bi_run} {GOLDEN_DIR / 'tiny-dense-bi'}",
        )
        why = self.needs("train_w1")
        if why:
            self.row("G1 run to run", "committed golden tiny-dense vs the W=1 run", False, why)
        else:
            r = check("tiny-dense", self.out / "train-w1", False)
            detail = (
                f"{r.mode} mode; "
                + (r.failures[0] if r.failures else "passed")
                + (
                    ""
                    if r.mode == "exact"
                    else " (this machine's numerics fingerprint differs from the golden's: "
                    + "; ".join(r.fingerprint_differences[:2])
                    + ")"
                )
            )
            self.row(
                "G1 run to run",
                "committed golden tiny-dense (steps 1-4) vs the W=1 run",
                r.passed,
                detail,
                f"titan-audit golden check {self.out / 'train-w1'} {GOLDEN_DIR / 'tiny-dense'}",
            )
        seed_run = self.path("golden_control", "golden-control-seed1")
        self.train_here(seed_run, ["steps=1", "seed=1", "determinism.batch_invariant=true"])
        r = check("tiny-dense-bi", seed_run, True, control=True)
        self.row(
            "G1 control",
            "a 1-step run with seed 1 must fail the tiny-dense-bi golden",
            not r.passed,
            r.failures[0] if r.failures else "it passed: the golden check proves nothing here",
            seed_run,
        )

    # ---------------------------------------------------------------- driver
    def summary(self, seconds: float, numerics: str) -> dict[str, Any]:
        return {
            "kind": "demo",
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "quick": self.plan.quick,
            "steps": self.plan.steps,
            "seconds": seconds,
            "numerics": numerics,
            "passed": self.passed,
            "rows": [r.__dict__ for r in ordered(self.rows)],
            "stages": self.stages,
            "runs": self.runs,
            **self.extra,
        }

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.result != "FAIL" for r in self.rows)


def vllm_status() -> tuple[bool, str]:
    """(usable, why not): usable iff `titan_audit.rl.vllm.available()` (a bool: the `vllm` extra is
    installed); otherwise the reason is a SKIP row's text with `INSTALL_HINT`. An extra that is
    installed but broken is not hidden here: the vLLM stage then fails with vLLM's own error."""
    from titan_audit.rl import vllm as rl_vllm

    if rl_vllm.available():
        return True, ""
    return False, f"skipped: vLLM is not installed here ({rl_vllm.INSTALL_HINT})"


def _order(row: Row) -> tuple[str, bool]:
    return (row.guarantee.split()[0] if row.guarantee.startswith("G") else "Z", row.guarantee.endswith("control"))


def ordered(rows: list[Row]) -> list[Row]:
    """The rows by guarantee, controls after their checks (the order of demo.json and the verdict table)."""
    return sorted(rows, key=_order)


def run(
    out: Path | None = None, *, quick: bool = False, verbose: bool = False, listener: Listener | None = None
) -> Result:
    """Run the demo into `out` (a new directory); `result.passed` iff every guarantee held. What
    happens goes to `listener` (default: the `titan_audit.demo.job` log); `verbose`: stages run
    with their output on (subprocess lines to `listener.on_output`, tracebacks of failed stages
    to `on_message`)."""
    from titan_audit.deterministic import fingerprint as numerics_fingerprint

    listener = listener or Listener()
    out = out or default_out_dir()
    if out.exists():
        raise ValueError(f"{out}: already exists; the demo writes new runs only (pick another --out)")
    plan = Plan.make(quick)
    start = time.perf_counter()
    out.mkdir(parents=True)
    fp = numerics_fingerprint()
    numerics = (
        f"numerics: torch {fp.torch_version} on {fp.device_kind} ({fp.device_name}), ISA {fp.cpu_capability}, "
        f"BLAS {fp.blas}"
    )
    demo = Demo(out, plan, verbose, listener)
    stages: list[tuple[str, str, Callable[[], None], str | None]] = [
        ("train_w2", f"G3: train {RECIPE} on 2 ranks (torchrun)", demo.train_w2, "train-w2"),
        ("train_w1", f"G3: train {RECIPE} on 1 rank", demo.train_w1, None),
        ("kill_resume", "G5: SIGKILL a run after a checkpoint, resume, compare", demo.kill_resume, "kill-resume-w1"),
        ("spot_checks", "G2: batch-invariance spot-checks", demo.spot_checks, None),
        ("goldens", "G1: committed goldens", demo.goldens, None),
        ("zero_gap", "G4: RL zero gap, built-in generator (+ constructed control)", demo.zero_gap, None),
        ("zero_gap_vllm", "G4: RL zero gap, vLLM generator", demo.zero_gap_vllm, None),
        ("elastic", "G3: compare W=2 with W=1, replay a checkpoint on W=1", demo.elastic, None),
    ]
    if plan.controls:
        stages.append(("control_w2", "G3 control: W=2 with determinism off", demo.control_w2, "control-w2"))
    listener.on_start(out, quick, numerics, len(stages) + 1)
    # the 2-rank run (torchrun start-up, two rank processes) overlaps the 1-rank stages that need
    # nothing from it; the stages that compare with it wait for it
    first, *rest = stages
    worker = threading.Thread(target=demo.stage, args=first, kwargs={"background": True}, daemon=True)
    worker.start()
    for name, title, fn, log_name in rest:
        if name in NEEDS_W2 and worker.is_alive():
            listener.on_status("waiting for the 2-rank run")
            worker.join()
        demo.stage(name, title, fn, log_name)
    worker.join()
    listener.on_status("writing the report")
    report_start = time.perf_counter()
    write_json_atomic(out / DEMO_FILE, demo.summary(time.perf_counter() - start, numerics))
    report = None
    try:
        from titan_audit.report import write_report

        report = write_report(out)
    except Exception as error:  # the verdicts stand; the report's failure is one more FAIL
        demo.row("report", "RUN/reports/report.html", False, f"{type(error).__name__}: {error}")
    seconds = time.perf_counter() - start
    write_json_atomic(out / DEMO_FILE, demo.summary(seconds, numerics))
    listener.on_done("report", time.perf_counter() - report_start)
    return Result(out, quick, demo.passed, ordered(demo.rows), seconds, numerics, demo.stages, report)
