"""Record a golden from a run, and update one deliberately, saying what changed.

Guarantees:
- `record_golden` keeps the run's audit records of the chosen steps (default: all) and phases
  (default: store.DEFAULT_PHASES), the chosen metric columns of those steps (default: loss,
  grad_norm, lr and aux_loss where the run has them), the run's manifest and the tolerance policy.
  The run must have a manifest with a numerics fingerprint: without one, no check could tell
  whether an exact comparison is valid. An existing golden is refused (use `update_golden`).
- `update_golden` rewrites an existing golden (even a corrupt one) atomically, keeping its
  steps, phases and tolerances unless new ones are given, and returns what changed: fingerprint
  fields, audit records (first divergence, counts), metric values, the selection and the policy.
  A golden whose content would not change is left as it is unless `force`.
- Guards (ValueError, i.e. exit 2, unless `force`): both refuse a run that a live process is
  still writing (its `RUN/.lock` is held: audit.run_lock.run_writer), and `update_golden`
  refuses a run whose model (the config's `model` section) differs from the golden's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from titan_audit.audit import config_diff
from titan_audit.audit.run_lock import run_writer
from titan_audit.audit.run_manifest import MANIFEST, read_manifest
from titan_audit.audit.run_metrics import METRICS
from titan_audit.audit.schema import PHASES
from titan_audit.golden.selection import (
    compare_selection,
    fingerprint_differences,
    float_bits,
    metric_values,
    read_run_metrics,
    select_records,
)
from titan_audit.golden.store import (
    DEFAULT_PHASES,
    DEFAULT_TOLERANCE,
    DEFAULT_TOLERANCES,
    Golden,
    GoldenCorrupt,
    Tolerance,
    read_golden,
    write_golden,
)


def _tolerances(
    metrics: list[str] | None, available: list[str], rtol: dict[str, float], atol: dict[str, float]
) -> dict[str, dict[str, float]]:
    names = metrics if metrics is not None else [m for m in DEFAULT_TOLERANCES if m in available]
    for name in list(names) + list(rtol) + list(atol):
        if name not in available:
            raise ValueError(
                f"metric {name!r} is not a column of the run's {METRICS} (has: {', '.join(available) or 'none'})"
            )
    for name in list(rtol) + list(atol):
        if name not in names:
            raise ValueError(f"a tolerance was given for metric {name!r}, which is not kept (kept: {', '.join(names)})")
    out = {}
    for name in names:
        bounds = dict(DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCE))
        bounds["rtol"] = float(rtol.get(name, bounds["rtol"]))
        bounds["atol"] = float(atol.get(name, bounds["atol"]))
        if bounds["rtol"] < 0 or bounds["atol"] < 0 or not all(map(math.isfinite, bounds.values())):
            raise ValueError(f"tolerance of metric {name!r} must be finite and >= 0, got {bounds}")
        out[name] = bounds
    return out


def _build(
    run_dir: Path,
    steps: list[int] | None,
    phases: list[str] | None,
    metrics: list[str] | None,
    rtol: dict[str, float],
    atol: dict[str, float],
    max_failures: int,
) -> dict[str, Any]:
    """Everything a golden of `run_dir` holds, as write_golden's keyword arguments."""
    manifest = read_manifest(run_dir)
    fp = manifest.get("fingerprint")
    if not isinstance(fp, dict) or "fingerprint_version" not in fp:
        raise ValueError(
            f"{run_dir / MANIFEST}: no numerics fingerprint; a golden needs one to choose exact or tolerance mode"
        )
    phases = list(DEFAULT_PHASES) if phases is None else phases
    records = select_records(run_dir, steps, phases)
    if records.num_rows == 0:
        raise ValueError(
            f"{run_dir}: no audit records in phases {', '.join(phases)}"
            + ("" if steps is None else f" at steps {steps}")
        )
    present = sorted(set(records["step"].to_pylist()))
    if steps is not None and present != steps:
        missing = sorted(set(steps) - set(present))
        raise ValueError(f"{run_dir}: no audit records at step(s) {missing} in phases {', '.join(phases)}")
    metrics_table = read_run_metrics(run_dir)
    available = [] if metrics_table is None else [c for c in metrics_table.column_names if c != "step"]
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0, got {max_failures}")
    tolerances = _tolerances(metrics, available, rtol, atol)
    kept_metrics = None
    if metrics_table is not None and tolerances:
        mask = pc.is_in(metrics_table["step"], value_set=pa.array(present, type=metrics_table["step"].type))
        kept_metrics = metrics_table.filter(mask).select(["step", *tolerances]).sort_by("step")
        lacking = sorted(set(present) - set(kept_metrics["step"].to_pylist()))
        if lacking:
            raise ValueError(f"{run_dir / METRICS}: no row for step(s) {lacking}")
    return {
        "audit": records,
        "metrics": kept_metrics,
        "manifest": manifest,
        "steps": present,
        "phases": [p for p in PHASES if p in phases],
        "tolerance": Tolerance(tolerances, max_failures),
        "source_run": str(run_dir),
    }


def check_not_being_written(run_dir: Path, force: bool = False) -> None:
    """ValueError (unless `force`) while a live process writes the run: a golden of a run still
    training would keep its first steps only, as if they were the whole run."""
    writer = None if force else run_writer(run_dir)
    if writer is not None:
        raise ValueError(
            f"{run_dir}: the run is still being written ({writer} holds {run_dir / '.lock'}); "
            "wait for it to end, or pass --force to keep the steps written so far"
        )


def check_same_model(golden: Golden, run_dir: Path, force: bool = False) -> None:
    """ValueError (unless `force`) when the run's model (the `model` section of its config)
    differs from the golden's: replacing a golden of one model by another is a new golden."""
    if force:
        return
    changes = config_diff.model_changes(golden.manifest.get("config"), read_manifest(run_dir).get("config"))
    if changes:
        shown = "; ".join(config_diff.change_text(c) for c in changes[:5])
        raise ValueError(
            f"{run_dir}: the model differs from the golden {golden.path}'s ({shown}); a golden of another "
            "model is a new golden: record it elsewhere, or pass --force to replace this one"
        )


def record_golden(
    run_dir: str | os.PathLike,
    golden_dir: str | os.PathLike,
    *,
    steps: list[int] | None = None,
    phases: list[str] | None = None,
    metrics: list[str] | None = None,
    rtol: dict[str, float] | None = None,
    atol: dict[str, float] | None = None,
    max_failures: int = 0,
    source: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Write a new golden of `run_dir` at `golden_dir` (refuses an existing one, and a run a live
    process is still writing unless `force`); a summary. `source` describes where the run came
    from (default: its path)."""
    golden_dir = Path(golden_dir)
    if golden_dir.exists():
        raise ValueError(
            f"{golden_dir} already exists; a golden is only replaced deliberately: use `titan-audit golden update`"
        )
    check_not_being_written(Path(run_dir), force)
    parts = _build(Path(run_dir), steps, phases, metrics, rtol or {}, atol or {}, max_failures)
    if source is not None:
        parts["source_run"] = source
    write_golden(golden_dir, **parts)
    return summarize(read_golden(golden_dir))


def summarize(golden: Golden) -> dict[str, Any]:
    files = golden.meta["files"]
    return {
        "golden": str(golden.path),
        "format_version": golden.meta["format_version"],
        "steps": golden.steps,
        "phases": golden.phases,
        "records": golden.audit.num_rows,
        "metrics": list(golden.tolerance.metrics),
        "tolerance": golden.tolerance.to_dict(),
        "bytes": sum(f["bytes"] for f in files.values()) + (golden.path / "golden.json").stat().st_size,
    }


def update_golden(
    run_dir: str | os.PathLike,
    golden_dir: str | os.PathLike,
    *,
    steps: list[int] | None = None,
    phases: list[str] | None = None,
    metrics: list[str] | None = None,
    rtol: dict[str, float] | None = None,
    atol: dict[str, float] | None = None,
    max_failures: int | None = None,
    source: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Replace the golden at `golden_dir` by one of `run_dir`; returns what changed. A golden whose
    content would not change (same fingerprint, hashes, metric bits, selection and policy) is left
    as it is (`rewritten` False: no churn in committed goldens) unless `force`. Refused (ValueError)
    unless `force`: a run a live process is still writing, and a run of another model (the `model`
    section of the config differs from the golden's)."""
    golden_dir, run_dir = Path(golden_dir), Path(run_dir)
    check_not_being_written(run_dir, force)
    old: Golden | None = None
    old_error = None
    try:
        old = read_golden(golden_dir)
    except GoldenCorrupt as error:
        old_error = str(error)
    except ValueError as error:
        raise ValueError(
            f"{error} (`golden update` replaces an existing golden; use `golden record` for a new one)"
        ) from None
    if old is not None:
        check_same_model(old, run_dir, force)
        steps = old.steps if steps is None else steps
        phases = old.phases if phases is None else phases
        metrics = list(old.tolerance.metrics) if metrics is None else metrics
        old_bounds = old.tolerance.metrics
        rtol = {m: old_bounds[m]["rtol"] for m in metrics if m in old_bounds} | (rtol or {})
        atol = {m: old_bounds[m]["atol"] for m in metrics if m in old_bounds} | (atol or {})
        max_failures = old.tolerance.max_failures if max_failures is None else max_failures
    parts = _build(run_dir, steps, phases, metrics, rtol or {}, atol or {}, max_failures or 0)
    if source is not None:
        parts["source_run"] = source
    changes: dict[str, Any] = {"golden": str(golden_dir), "run": str(run_dir), "previous_corrupt": old_error}
    unchanged = False
    if old is not None:
        changes.update(_changes(old, run_dir, parts))
        unchanged = (
            not changes["fingerprint_changes"]
            and changes["audit"]["identical"]
            and not changes["metric_changes"]
            and all(changes[k]["before"] == changes[k]["after"] for k in ("steps", "phases", "tolerance"))
        )
    changes["rewritten"] = force or not unchanged
    if changes["rewritten"]:
        write_golden(golden_dir, **parts, overwrite=True)
    changes["summary"] = summarize(read_golden(golden_dir))
    return changes


def _changes(old: Golden, run_dir: Path, parts: dict[str, Any]) -> dict[str, Any]:
    new_fp = parts["manifest"].get("fingerprint")
    fp = fingerprint_differences(old.fingerprint, new_fp, str(old.path / MANIFEST), str(run_dir / MANIFEST))
    selection = Golden(
        old.path,
        {**old.meta, "steps": parts["steps"], "phases": parts["phases"]},
        old.manifest,
        old.audit,
        old.metrics,
        old.tolerance,
    )
    audit = compare_selection(selection, run_dir)
    metric_changes = []
    for name in sorted(set(old.tolerance.metrics) | set(parts["tolerance"].metrics)):
        before, after = metric_values(old.metrics, name), metric_values(parts["metrics"], name)
        changed = [s for s in sorted(set(before) | set(after)) if float_bits(before.get(s)) != float_bits(after.get(s))]
        if changed:
            diffs = [
                abs(float(after[s]) - float(before[s]))
                for s in changed
                if isinstance(before.get(s), (int, float)) and isinstance(after.get(s), (int, float))
            ]
            metric_changes.append(
                {
                    "metric": name,
                    "steps_changed": len(changed),
                    "first_step": changed[0],
                    "max_abs_change": max(diffs) if diffs else None,
                }
            )
    return {
        "fingerprint_changes": fp,
        "audit": {
            "identical": audit.identical,
            "compared": audit.compared,
            "differing": audit.differing,
            "removed": audit.only_in_a,
            "added": audit.only_in_b,
            "first_divergence": audit.to_dict()["first_divergence"],  # JSON-safe (no NaN)
        },
        "metric_changes": metric_changes,
        "steps": {"before": old.steps, "after": parts["steps"]},
        "phases": {"before": old.phases, "after": parts["phases"]},
        "tolerance": {"before": old.tolerance.to_dict(), "after": parts["tolerance"].to_dict()},
    }
