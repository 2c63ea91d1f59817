"""On-policy verification (`titan-audit verify-onpolicy`): the zero-gap run, its constructed
control and its native-ops run, the report and the verdict.

    result = verify_onpolicy("rl-tiny", Path("runs/v"), steps=20, control=True)
    result.rc          # non-zero: a run's launch failed (the exit code to pass on); verdict None
    result.passed      # zero gap, and with `control` the control showed a gap
    result.verdict     # the JSON verdict (keys below)

Guarantees:
- RUN: the run as configured with `verify = true`; its verdict `zero_gap` (rl/report.py): batch-
  invariant mode and no token whose generator log-prob differs by any bit from the trainer's.
- `control`: RUN/control, the same run with `control = "generator-weight-ulp"` (rl/control.py:
  the generator is sent the trainer's weights with one element one ulp off), which must show a
  gap: the check shown able to fail by a difference the project constructs, on any CPU. A control
  that shows no gap fails the verification (the check proved nothing).
- `compare_default`: RUN/compare-default, the same run with native ops (`determinism.
  batch_invariant = false`), reported only: whether native ops leave a gap depends on what the
  CPU's libraries do (an Intel Xeon's MKL may give decode and full forward the same bits), so it
  is part of no verdict.
- `passed` iff RUN has zero gap and, with `control`, the control shows a gap.
- The verdict's keys: zero_gap, steps, tokens_compared, tokens_differing, steps_with_gap,
  first_step_with_gap, max_abs_diff, reward_first10, reward_last10, run, report_md, report_html,
  passed; with `control` a "control" object (run, control, tokens_compared, tokens_differing,
  steps_with_gap, max_abs_diff, shows_gap); with `compare_default` a "default" object
  (tokens_compared, tokens_differing, steps_with_gap, max_abs_diff).
- Runs go through the launcher's `start` with the RL job (the checks of `titan-audit rl`: bad
  input is a ValueError before anything is written); the companions are made after RUN, inside it by default (trainer/
  run_dir.py's COMPANION_RUNS, so --overwrite moves them aside with it), or where `control_out` /
  `default_out` say (new run directories: the demo keeps its runs side by side).
- A launch that fails stops the chain: `rc` is its exit code and `failed` the run it was making;
  nothing else is set and no report is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_audit.rl.control import CONFIG_KEY, CONTROLS

CONTROL_RUN = "control"  # RUN/control: the constructed control
DEFAULT_RUN = "compare-default"  # RUN/compare-default: native ops, reported only
CONTROL = CONTROLS[0]  # the control verify-onpolicy runs: "generator-weight-ulp"

VERDICT_KEYS = (
    "zero_gap",
    "steps",
    "tokens_compared",
    "tokens_differing",
    "steps_with_gap",
    "first_step_with_gap",
    "max_abs_diff",
    "reward_first10",
    "reward_last10",
)
COMPANION_KEYS = ("tokens_compared", "tokens_differing", "steps_with_gap", "max_abs_diff")


@dataclass
class Verification:
    rc: int  # non-zero: a launch failed with this exit code (nothing else is set but `failed`)
    failed: Path | None = None  # the run whose launch failed
    passed: bool = False
    verdict: dict[str, Any] | None = None
    report: dict[str, Any] | None = None  # write_onpolicy_report's: md, html and the summaries

    @property
    def exit_code(self) -> int:
        """What `titan-audit verify-onpolicy` exits with: a failed launch's code, else 0 iff passed, else 1."""
        return self.rc or (0 if self.passed else 1)


def verify_onpolicy(
    source: str,
    out: str | Path,
    *,
    steps: int,
    init: str | None = None,
    nproc: int | str | None = None,
    overwrite: bool | str = False,
    overrides: Sequence[str] = (),
    quiet: bool = False,
    control: bool = False,
    compare_default: bool = False,
    control_out: str | Path | None = None,
    default_out: str | Path | None = None,
) -> Verification:
    """Run RUN (and its companions: in RUN/control and RUN/compare-default unless `control_out` and
    `default_out` name other new directories), write RUN/reports/onpolicy.{md,html}; see the
    module docstring."""
    from titan_audit.rl.loop import RL_JOB
    from titan_audit.rl.report import control_shows_gap, write_onpolicy_report
    from titan_audit.trainer.launch import LaunchOptions
    from titan_audit.trainer.launch import start as start_job

    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    out = Path(out)
    common = [*overrides, "verify=true"]

    def start(where: Path, extra: list[str], overwrite_it: bool | str) -> int:
        options = LaunchOptions(overwrite=overwrite_it, init=init, quiet=quiet)
        return start_job(RL_JOB, source, where, nproc=nproc, steps=steps, overrides=[*common, *extra], options=options)

    rc = start(out, [], overwrite)
    if rc:
        return Verification(rc, out)
    control_run = default_run = None
    if control:
        control_run = out / CONTROL_RUN if control_out is None else Path(control_out)
        rc = start(control_run, [f"{CONFIG_KEY}={CONTROL}"], False)
        if rc:
            return Verification(rc, control_run)
    if compare_default:
        default_run = out / DEFAULT_RUN if default_out is None else Path(default_out)
        rc = start(default_run, ["determinism.batch_invariant=false"], False)
        if rc:
            return Verification(rc, default_run)
    report = write_onpolicy_report(out, default_run, control_run)
    summary = report["summary"]
    verdict: dict[str, Any] = {key: summary[key] for key in VERDICT_KEYS}
    verdict.update({"run": str(out), "report_md": report["md"], "report_html": report["html"]})
    passed = bool(summary["zero_gap"])
    if report["control"] is not None:
        c = report["control"]
        shows = control_shows_gap(c)
        verdict["control"] = {
            "run": c["run"],
            "control": c["control"],
            **{k: c[k] for k in COMPANION_KEYS},
            "shows_gap": shows,
        }
        passed = passed and shows
    if report["default"] is not None:
        d = report["default"]
        verdict["default"] = {k: d[k] for k in COMPANION_KEYS}
    verdict["passed"] = passed
    return Verification(0, passed=passed, verdict=verdict, report=report)
