"""G3 elastic: the 2-rank and the 1-rank run compare identical record for record, and the 2-rank
run's mid-run checkpoint replayed on 1 rank gives the same later steps; its negative control (not
with --quick): the 2-rank run with determinism off (plain all_reduce) must differ from the 1-rank
run, and the report maps where.

Guarantees: every row names what it compared and how many records; a control that finds no
difference FAILs (the check would prove nothing).
"""

from __future__ import annotations

from titan_audit.demo.plan import RECIPE
from titan_audit.demo.runner import Demo


def elastic(demo: Demo) -> None:
    from titan_audit.audit import compare_runs
    from titan_audit.trainer.replay import elastic_replay

    why = demo.needs("train_w1", "train_w2")
    w1, w2 = demo.out / "train-w1", demo.out / "train-w2"
    if why:
        demo.row("G3 elastic", "W=2 run == W=1 run", False, why)
    else:
        same = compare_runs(w2, w1)
        demo.row(
            "G3 elastic",
            f"{RECIPE} {demo.plan.steps} steps, W=2 == W=1, every audit record",
            same.identical,
            f"{same.compared} records compared, {same.differing} differ, "
            f"{same.only_in_a + same.only_in_b} in one run only",
            f"titan-audit compare {w2} {w1}",
        )
    why = demo.needs("train_w2")
    k = demo.plan.checkpoint_step
    if why:
        demo.row("G3 elastic", "replay of a mid-run checkpoint at another W", False, why)
        return
    replay = demo.path("replay_w1", "replay-w1")
    result, to_step = elastic_replay(w2, k, replay, nproc=1, quiet=not demo.verbose)
    demo.row(
        "G3 elastic",
        f"W=2 checkpoint of step {k} replayed on W=1: steps {k + 1}-{to_step}",
        result.identical,
        f"{result.compared} records compared, {result.differing} differ",
        replay,
    )


def control_w2(demo: Demo) -> None:
    from titan_audit.audit import compare_runs

    out = demo.path("control_w2", "control-w2-nondeterministic")
    rc = demo.train_subprocess("control-w2", out, [*demo.plan.train_overrides(), "determinism.enabled=false"], nproc=2)
    if rc:
        raise RuntimeError(f"torchrun exited {rc}; see {demo.out / 'logs' / 'control-w2.log'}")
    why = demo.needs("train_w1")
    if why:
        demo.row("G3 control", "plain all_reduce at W=2 differs", False, why)
        return
    control = compare_runs(demo.out / "train-w1", out)
    fd = control.first_divergence
    detail = (
        "identical: the check proves nothing here"
        if fd is None
        else f"differs, first at step {fd['step']} phase {fd['phase']} ({fd['name']}); "
        f"{control.differing} records differ"
    )
    demo.row(
        "G3 control",
        "determinism off (plain all_reduce) at W=2 vs W=1 must differ",
        fd is not None,
        detail,
        f"titan-audit compare {demo.out / 'train-w1'} {out}",
    )
    demo.extra.setdefault("divergence", []).append(
        {"a": "train-w1", "b": out.name, "label": "W=1 vs W=2 with determinism off (plain all_reduce)"}
    )
