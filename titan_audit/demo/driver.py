"""`titan-audit demo`: every guarantee proven on this machine, end to end, then a verdict table.

    result = run(Path("runs/demo"), quick=False)   # result.passed False: a guarantee failed (the CLI exits 1)

S steps of `tiny-dense` on the built-in synthetic corpus with the full audit (data, forward and
backward of every module, loss, reduced gradients, optimizer state, parameters) and a checkpoint
every S/2 steps (S = 8, or 4 with --quick), then the stages of demo/stages/: G3 elastic, G5 kill
and resume, G4 zero gap, G2 batch invariance, G1 run to run, each with its negative control.
Then OUT/demo.json (the verdicts, runs and timings) and the run report OUT/reports/report.html
and report.md (titan_audit.report).

Guarantees:
- a stage that fails is a FAIL row with its reason (and log); the stages that need it are FAIL
  rows too ("needs ..."); nothing is skipped silently; `result.passed` iff no row FAILs;
- the 2-rank run (torchrun start-up, two rank processes) runs in a background thread alongside
  the 1-rank stages that need nothing from it; the stages that compare with it wait for it;
- subprocess stages write their output to OUT/logs/<stage>.log (passed on line by line with
  `verbose`: the CLI's -v streams it); in-process stages run quiet unless `verbose`;
- no terminal presentation here: what happens goes to a `Listener` (demo/listener.py; the
  default logs, `titan_audit.cli.demo_view` draws a progress bar and the verdict table) and `run`
  returns a `Result` (the verdict rows, timings, the report's paths).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from titan_audit.atomic import write_json_atomic
from titan_audit.demo.listener import Listener
from titan_audit.demo.plan import DEMO_FILE, RECIPE, Plan, default_out_dir
from titan_audit.demo.runner import Demo
from titan_audit.demo.stages import batch_invariance, elastic, goldens, kill_resume, train, zero_gap
from titan_audit.demo.verdicts import Result, ordered

NEEDS_W2 = ("elastic", "control_w2")  # the stages that wait for the background 2-rank run

Stage = tuple[str, str, Callable[[Demo], None], str | None]  # name, title, function, log name


def stages(plan: Plan) -> list[Stage]:
    """The stages in the order they run; the first (the 2-rank run) runs in the background. The
    functions are looked up when this is called, so a test can replace one in its module."""
    table: list[Stage] = [
        ("train_w2", f"G3: train {RECIPE} on 2 ranks (torchrun)", train.train_w2, "train-w2"),
        ("train_w1", f"G3: train {RECIPE} on 1 rank", train.train_w1, None),
        (
            "kill_resume",
            "G5: SIGKILL a run after a checkpoint, resume, compare",
            kill_resume.kill_resume,
            "kill-resume-w1",
        ),
        ("spot_checks", "G2: batch-invariance spot-checks", batch_invariance.spot_checks, None),
        ("goldens", "G1: committed goldens", goldens.goldens, None),
        ("zero_gap", "G4: RL zero gap, built-in generator (+ constructed control)", zero_gap.zero_gap, None),
        ("zero_gap_vllm", "G4: RL zero gap, vLLM generator", zero_gap.zero_gap_vllm, None),
        ("elastic", "G3: compare W=2 with W=1, replay a checkpoint on W=1", elastic.elastic, None),
    ]
    if plan.controls:
        table.append(("control_w2", "G3 control: W=2 with determinism off", elastic.control_w2, "control-w2"))
    return table


def run(
    out: Path | None = None, *, quick: bool = False, verbose: bool = False, listener: Listener | None = None
) -> Result:
    """Run the demo into `out` (a new directory); `result.passed` iff every guarantee held. What
    happens goes to `listener` (default: the `titan_audit.demo` log); `verbose`: stages run
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
    table = stages(plan)
    listener.on_start(out, quick, numerics, len(table) + 1)
    first, *rest = table
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
