"""G1 run to run: the committed goldens (titan_audit/goldens/tiny-dense and tiny-dense-bi, package
data) check against runs made now: the BI golden must be exact on any CPU, tiny-dense is exact
when the numerics fingerprints are compatible; negative control: a run with another seed must
fail the BI golden.

Guarantees: each check's mode, records and notes go to demo.json (`goldens`); missing goldens
(a broken install) raise, so the stage is a FAIL row that says to reinstall.
"""

from __future__ import annotations

from pathlib import Path

from titan_audit.demo.runner import Demo
from titan_audit.goldens import GOLDENS_DIR as GOLDEN_DIR


def goldens(demo: Demo) -> None:
    from titan_audit.golden import check_golden

    if not (GOLDEN_DIR / "tiny-dense-bi" / "golden.json").is_file():
        raise RuntimeError(
            f"{GOLDEN_DIR}: the committed goldens are not there (package data of titan-audit: reinstall it)"
        )
    results = demo.extra.setdefault("goldens", [])

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

    bi_run = demo.path("golden_bi", "golden-bi-w1")
    demo.train_here(bi_run, ["steps=4", "determinism.batch_invariant=true"])
    r = check("tiny-dense-bi", bi_run, True)
    demo.row(
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
    why = demo.needs("train_w1")
    if why:
        demo.row("G1 run to run", "committed golden tiny-dense vs the W=1 run", False, why)
    else:
        r = check("tiny-dense", demo.out / "train-w1", False)
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
        demo.row(
            "G1 run to run",
            "committed golden tiny-dense (steps 1-4) vs the W=1 run",
            r.passed,
            detail,
            f"titan-audit golden check {demo.out / 'train-w1'} {GOLDEN_DIR / 'tiny-dense'}",
        )
    seed_run = demo.path("golden_control", "golden-control-seed1")
    demo.train_here(seed_run, ["steps=1", "seed=1", "determinism.batch_invariant=true"])
    r = check("tiny-dense-bi", seed_run, True, control=True)
    demo.row(
        "G1 control",
        "a 1-step run with seed 1 must fail the tiny-dense-bi golden",
        not r.passed,
        r.failures[0] if r.failures else "it passed: the golden check proves nothing here",
        seed_run,
    )
