"""The training runs the other stages compare: `tiny-dense` for the plan's steps with the full audit
on 2 ranks (`titan-audit train --nproc 2` as a child process, torchrun and gloo) and on 1 rank (in
this process).

Guarantees: both runs are made by the user's own commands (their checks, run lock and launcher),
with the same overrides (Plan.train_overrides); a failed launch raises, so its stage is a FAIL row
and the stages that compare with it say so.
"""

from __future__ import annotations

from titan_audit.demo.plan import RECIPE
from titan_audit.demo.runner import Demo


def train_w2(demo: Demo) -> None:
    out = demo.path("train_w2", "train-w2")
    rc = demo.train_subprocess("train-w2", out, demo.plan.train_overrides(), nproc=2)
    if rc:
        raise RuntimeError(f"torchrun exited {rc}; see {demo.out / 'logs' / 'train-w2.log'}")
    demo.say(f"  trained {RECIPE} for {demo.plan.steps} steps on 2 ranks (full audit) -> {out}")


def train_w1(demo: Demo) -> None:
    out = demo.path("train_w1", "train-w1")
    demo.train_here(out, demo.plan.train_overrides())
    demo.say(f"  trained the same run on 1 rank -> {out}")
