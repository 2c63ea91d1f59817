"""Check a run against a golden: exact when the numerics fingerprints are compatible, in an
explicit, reported tolerance mode otherwise.

Guarantees:
- `check_golden` picks the mode from the numerics fingerprints (deterministic.incompatibilities):
  * exact, when they are compatible: the run's records of the golden's steps and phases are
    compared with the golden's by hash, through `audit.compare_runs` (same keys, same first
    divergence, same spread), and the golden's metrics are compared bitwise (the raw float64
    bits; -0.0 != +0.0). Nothing is compared with a tolerance.
  * tolerance, when they are not (or the run has no fingerprint): audit hashes are not compared
    (they are not expected to match); every golden metric at every golden step must be present
    in the run and within |run - golden| <= atol + rtol * |golden|, except for at most
    `max_failures` points (the failure budget). The result names the fingerprint fields that
    differ. A golden without metrics fails in tolerance mode: there would be nothing to check.
  The result always says which mode ran (`mode`), and `require_exact=True` turns tolerance mode
  into a failure, so a CI job that must be bitwise cannot pass in the weaker mode.
- Corrupt or unreadable goldens raise (store.GoldenCorrupt / ValueError) before any comparison:
  corruption is never reported as a numerics mismatch.
- A run that holds no record (exact mode) or no metric value (tolerance mode) at any of the
  golden's steps is refused (ValueError): a check of nothing is bad input, not a verdict.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from titan_audit.audit import config_diff
from titan_audit.audit.compare import CompareResult, steps_text
from titan_audit.audit.log import read_audit_log
from titan_audit.audit.run_manifest import MANIFEST, digest_differences, read_manifest
from titan_audit.audit.run_metrics import METRICS
from titan_audit.golden.selection import (
    compare_selection,
    config_differences,
    fingerprint_differences,
    float_bits,
    kernels_change,
    kernels_change_note,
    metric_steps,
    metric_values,
    read_run_metrics,
)
from titan_audit.golden.store import Golden, read_golden, within


@dataclass
class GoldenCheck:
    golden: str
    run: str
    mode: str  # "exact" or "tolerance"
    passed: bool
    failures: list[str]  # why it failed, one line each (empty when passed)
    fingerprint_differences: list[str]
    config_differences: list[str]
    compare: CompareResult | None  # exact mode: the audit comparison
    metric_mismatches: list[dict[str, Any]]
    metric_points: int  # (metric, step) points compared
    max_failures: int
    require_exact: bool
    notes: list[str] = field(default_factory=list)
    kernels_changed: dict[str, str | None] | None = None  # kernels_change(): a kernel version change

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "mode": self.mode,
            "golden": self.golden,
            "run": self.run,
            "failures": self.failures,
            "fingerprint_differences": self.fingerprint_differences,
            "config_differences": self.config_differences,
            "audit": None if self.compare is None else self.compare.to_dict(),
            "metric_points": self.metric_points,
            "metric_mismatches": [_json_float(m) for m in self.metric_mismatches],
            "max_failures": self.max_failures,
            "require_exact": self.require_exact,
            "notes": self.notes,
            "kernels_changed": self.kernels_changed,
        }


def _json_float(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in obj.items()}


def _compare_metrics(
    golden: Golden, run_metrics: pa.Table | None, exact: bool
) -> tuple[list[dict[str, Any]], int, list[str]]:
    mismatches: list[dict[str, Any]] = []
    missing: list[str] = []
    points = 0
    for name, bounds in golden.tolerance.metrics.items():
        expected = metric_values(golden.metrics, name)
        actual = metric_values(run_metrics, name)
        for step, value in sorted(expected.items()):
            if step not in actual:
                missing.append(f"{name} at step {step}")
                continue
            points += 1
            got = actual[step]
            if exact:
                bad = float_bits(got) != float_bits(value)
            else:
                bad = (
                    got is None or value is None or not within(float(got), float(value), bounds["rtol"], bounds["atol"])
                )
            if bad:
                entry = {"metric": name, "step": step, "golden": value, "run": got}
                if not exact and got is not None and value is not None:
                    entry["abs_diff"] = abs(float(got) - float(value))
                    entry["bound"] = bounds["atol"] + bounds["rtol"] * abs(float(value))
                mismatches.append(entry)
    return mismatches, points, missing


def _check_overlap(golden: Golden, run_dir: Path) -> None:
    """ValueError when the run holds no record at all in the golden's steps and phases: a check of
    nothing (another run, a typo) is bad input, not a numerics verdict."""
    expr = ds.field("phase").isin(pa.array(golden.phases, type=pa.string()))
    steps = pc.unique(read_audit_log(run_dir, columns=["step"], filter=expr)["step"]).to_pylist()
    if not set(steps) & set(golden.steps):
        held = steps_text(steps) if steps else "none"
        raise ValueError(
            f"{run_dir}: no audit records at the golden's steps {steps_text(golden.steps)} in phases "
            f"{', '.join(golden.phases)} (the run has steps {held} in those phases): nothing to check"
        )


def check_golden(
    run_dir: str | os.PathLike, golden_dir: str | os.PathLike, *, require_exact: bool = False
) -> GoldenCheck:
    """Check `run_dir` against the golden at `golden_dir` (see the module docstring)."""
    golden = read_golden(golden_dir)  # verifies integrity first: corruption raises here
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    read_audit_log(run_dir, columns=["step"])  # bad input (no audit log, damaged part) -> ValueError now
    run_fp = manifest.get("fingerprint") if isinstance(manifest.get("fingerprint"), dict) else None
    fp_diff = fingerprint_differences(golden.fingerprint, run_fp, str(golden.path / MANIFEST), str(run_dir / MANIFEST))
    kernels_changed = kernels_change(golden.fingerprint, run_fp)
    cfg_diff = config_differences(golden.manifest.get("config"), manifest.get("config"))
    run_metrics = read_run_metrics(run_dir)
    failures: list[str] = []
    notes: list[str] = []
    notes.extend(
        config_diff.expected_differences(golden.manifest.get("config"), manifest.get("config"), names=("golden", "run"))
    )
    compare = None
    if not fp_diff:
        mode = "exact"
        _check_overlap(golden, run_dir)
        compare = compare_selection(golden, run_dir)
        if not compare.identical:
            notes.extend(digest_differences(golden.manifest, manifest, ("golden", "run"), differed=True))
            first = compare.first_divergence
            failures.append(
                f"audit records differ: first divergence at step {first['step']}, phase {first['phase']}, "
                f"microbatch {first['microbatch']}, name {first['name']} ({first['kind']})"
            )
        mismatches, points, missing = _compare_metrics(golden, run_metrics, exact=True)
        if mismatches:
            m = mismatches[0]
            failures.append(
                f"{len(mismatches)} metric value(s) differ bitwise; first: {m['metric']} at step {m['step']}: "
                f"golden {m['golden']!r}, run {m['run']!r}"
            )
        if missing:
            failures.append(f"the run lacks metric values: {', '.join(missing[:10])}")
    else:
        mode = "tolerance"
        notes.append(
            "numerics fingerprints differ, so bitwise equality is not expected; audit hashes were "
            "NOT compared, only metrics within tolerance: " + "; ".join(fp_diff)
        )
        if kernels_changed is not None:
            notes.append(kernels_change_note(kernels_changed))
        if require_exact:
            failures.append(
                "exact comparison required, but the numerics fingerprints differ: "
                + "; ".join(fp_diff)
                + ("" if kernels_changed is None else f" ({kernels_change_note(kernels_changed)})")
            )
        mismatches, points, missing = _compare_metrics(golden, run_metrics, exact=False)
        if points == 0 and missing:  # not one (metric, step) point of the golden is in the run
            raise ValueError(
                f"{run_dir}: no metric values at the golden's steps {steps_text(golden.steps)} "
                f"(the run's {METRICS} has steps {steps_text(metric_steps(run_metrics))}): nothing to check"
            )
        if not golden.tolerance.metrics or (golden.metrics is None):
            failures.append(f"{golden.path}: the golden keeps no metrics, so tolerance mode has nothing to check")
        if missing:
            failures.append(f"the run lacks metric values: {', '.join(missing[:10])}")
        if len(mismatches) > golden.tolerance.max_failures:
            m = mismatches[0]
            failures.append(
                f"{len(mismatches)} of {points} metric points outside tolerance "
                f"(budget {golden.tolerance.max_failures}); "
                f"first: {m['metric']} at step {m['step']}: golden {m['golden']!r}, run {m['run']!r}"
            )
        elif mismatches:
            notes.append(
                f"{len(mismatches)} metric point(s) outside tolerance, within the failure budget "
                f"of {golden.tolerance.max_failures}"
            )
    return GoldenCheck(
        golden=str(golden.path),
        run=str(run_dir),
        mode=mode,
        passed=not failures,
        failures=failures,
        fingerprint_differences=fp_diff,
        config_differences=cfg_diff,
        compare=compare,
        metric_mismatches=mismatches,
        metric_points=points,
        max_failures=golden.tolerance.max_failures,
        require_exact=require_exact,
        notes=notes,
        kernels_changed=kernels_changed,
    )
