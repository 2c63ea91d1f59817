"""G5 kill and resume: the 1-rank run, started in a child process, is sent SIGKILL as soon as its
mid-run checkpoint is on disk, resumed with --resume, and compared with the uninterrupted run.

Guarantees: the row PASSes only if the child really died of SIGKILL, every audit record matches
the uninterrupted run's, and the final checkpoints' tensor hashes are equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

from titan_audit.demo.runner import Demo


def kill_resume(demo: Demo) -> None:
    from titan_audit.audit import compare_runs
    from titan_audit.trainer.checkpoint import Checkpointer

    out = demo.path("kill_resume", "kill-resume-w1")
    k, steps = demo.plan.checkpoint_step, demo.plan.steps
    kill: dict[str, Any] = {"checkpoint_step": k}

    started = time.perf_counter()

    def killer(proc: subprocess.Popen) -> None:
        target = Checkpointer(out).path(k)
        while proc.poll() is None and not target.is_dir():
            time.sleep(0.01)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kill.update(pid=proc.pid, after_s=time.perf_counter() - started)

    rc = demo.train_subprocess("kill-resume-w1", out, demo.plan.train_overrides(), nproc=None, on_start=killer)
    kill["returncode"] = rc
    demo.extra["kill"] = kill
    if rc != -signal.SIGKILL:
        raise RuntimeError(
            f"the run was to be killed after its step-{k} checkpoint but exited {rc} "
            f"(see {demo.out / 'logs' / 'kill-resume-w1.log'})"
        )
    done = Checkpointer(out).steps()
    demo.say(f"  SIGKILL to pid {kill['pid']} once checkpoint {k} was on disk (checkpoints left: {done}); resuming")
    demo.train_here(out, demo.plan.train_overrides(), resume=True)
    why = demo.needs("train_w1")
    if why:
        demo.row("G5 kill -9 + resume", "resumed run == uninterrupted run", False, why)
        return
    ref = demo.out / "train-w1"
    same = compare_runs(ref, out)
    hashes = [json.loads((Checkpointer(r).path(steps) / "hashes.json").read_text())["tensors"] for r in (ref, out)]
    ok = same.identical and hashes[0] == hashes[1]
    demo.row(
        "G5 kill -9 + resume",
        f"SIGKILL after the step-{k} checkpoint, --resume, == uninterrupted run",
        ok,
        f"{same.compared} records compared, {same.differing} differ; step-{steps} checkpoint hashes "
        f"{'equal' if hashes[0] == hashes[1] else 'DIFFER'} ({len(hashes[0])} tensors)",
        f"titan-audit compare {ref} {out}",
    )
