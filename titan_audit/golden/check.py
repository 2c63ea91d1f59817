"""Record a golden from a run, check a run against a golden, update a golden deliberately.

Guarantees:
- `record_golden` keeps the run's audit records of the chosen steps (default: all) and phases
  (default: store.DEFAULT_PHASES), the chosen metric columns of those steps (default: loss,
  grad_norm, lr and aux_loss where the run has them), the run's manifest and the tolerance policy. The run
  must have a manifest with a numerics fingerprint: without one, no check could tell whether an
  exact comparison is valid. An existing golden is refused (use `update_golden`).
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
- `update_golden` rewrites an existing golden (even a corrupt one) atomically, keeping its
  steps, phases and tolerances unless new ones are given, and returns what changed: fingerprint
  fields, audit records (first divergence, counts), metric values, the selection and the policy.
- Guards (ValueError, i.e. exit 2, unless `force`): `record_golden` and `update_golden` refuse a run
  that a live process is still writing (its `RUN/.lock` is held: audit.run_manifest.run_writer),
  and `update_golden` refuses a run whose model (the config's `model` section) differs from the
  golden's. `check_golden` refuses a run that holds no record (exact mode) or no metric value
  (tolerance mode) at any of the golden's steps: a check of nothing is bad input, not a verdict.
"""

from __future__ import annotations

import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from titan_audit.audit import config_diff
from titan_audit.audit.compare import CompareResult, compare_runs, steps_text
from titan_audit.audit.log import AuditLogWriter, read_audit_log
from titan_audit.audit.run_manifest import MANIFEST, read_manifest, run_writer
from titan_audit.audit.run_metrics import METRICS, read_metrics
from titan_audit.audit.schema import PHASES, SCHEMA, check_phase
from titan_audit.golden.store import (
    DEFAULT_PHASES,
    DEFAULT_TOLERANCE,
    DEFAULT_TOLERANCES,
    Golden,
    GoldenCorrupt,
    Tolerance,
    read_golden,
    within,
    write_golden,
)

# Config keys that never change the bits of a step: audit.config_diff's (compare uses the same rule).
CONFIG_KEYS_IGNORED = config_diff.CONFIG_KEYS_IGNORED


# ---------------------------------------------------------------------------------- inputs
def parse_steps(spec: str | None) -> list[int] | None:
    """'1-4,7' -> [1, 2, 3, 4, 7]; None or 'all' -> None (every step of the run)."""
    if spec is None or spec.strip() == "all":
        return None
    steps: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"--steps {spec!r}: {part!r} is not a step or a range like 1-4")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if hi < lo:
            raise ValueError(f"--steps {spec!r}: empty range {part!r}")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


def parse_phases(spec: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    if spec is None:
        return None
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    return [check_phase(p.strip()) for p in items if p.strip()]


def _select_records(run_dir: Path, steps: list[int] | None, phases: list[str]) -> pa.Table:
    """The run's records in `phases` (and `steps`), filtered while reading (a run may be large)."""
    expr = ds.field("phase").isin(pa.array(phases, type=pa.string()))
    if steps is not None:
        expr = expr & ds.field("step").isin(pa.array(steps, type=pa.int64()))
    return read_audit_log(run_dir, filter=expr)


def _read_metrics(run_dir: Path) -> pa.Table | None:
    table = read_metrics(run_dir)
    if table is None:
        return None
    steps = table["step"].to_pylist()
    if len(set(steps)) != len(steps):
        raise ValueError(f"{run_dir / METRICS}: a step appears more than once")
    return table


def _metric_values(table: pa.Table | None, name: str) -> dict[int, Any]:
    if table is None or name not in table.column_names:
        return {}
    return dict(zip(table["step"].to_pylist(), table[name].to_pylist()))


def config_differences(golden_config: Any, run_config: Any) -> list[str]:
    """'key: golden X, run Y' for every config key that differs (audit.config_diff's rule)."""
    return [f"{key}: golden {a!r}, run {b!r}" for key, a, b in config_diff.config_changes(golden_config, run_config)]


def fingerprint_differences(golden_fp: dict | None, run_fp: dict | None, golden: str, run: str) -> list[str]:
    """The compared fingerprint fields that differ ([] = compatible: exact mode is valid)."""
    from titan_audit.deterministic import NumericsFingerprint, incompatibilities

    if golden_fp is None:
        return [f"no numerics fingerprint in {golden}"]
    if run_fp is None:
        return [f"no numerics fingerprint in {run}"]
    a = NumericsFingerprint.from_dict(golden_fp, source=golden)
    b = NumericsFingerprint.from_dict(run_fp, source=run)
    return incompatibilities(a, b)


def kernels_change(golden_fp: dict | None, run_fp: dict | None) -> dict[str, str | None] | None:
    """{"golden": ..., "run": ...} when both runs used batch-invariant kernels of different
    versions (`bi_kernels` in the fingerprint), else None: such a failure comes from a kernel
    release that moved bits, not from the run."""
    golden_kernels = (golden_fp or {}).get("bi_kernels")
    run_kernels = (run_fp or {}).get("bi_kernels")
    if golden_kernels is None or run_kernels is None or golden_kernels == run_kernels:
        return None
    return {"golden": golden_kernels, "run": run_kernels}


def _gemm_order(kernels: str | None) -> str:
    """The gemm order a `bi_kernels` string names (deterministic/numerics.py: " gemm-v2" or none = v1)."""
    return "v2" if kernels and kernels.endswith(" gemm-v2") else "v1"


def kernels_change_note(change: dict[str, str | None]) -> str:
    note = (
        f"the batch-invariant kernels changed version (golden {change['golden']!r}, run {change['run']!r}): "
        "a kernel release that moves bits changes every BI run's hashes once, so this difference comes "
        "from the upgrade, not from the run; `titan-audit golden update RUN GOLDEN` re-records the golden"
    )
    golden_order, run_order = _gemm_order(change["golden"]), _gemm_order(change["run"])
    if golden_order != run_order:
        note += (
            f"; the gemm order differs (golden {golden_order}, run {run_order}): a run made with "
            f"--set determinism.bi_kernels={golden_order} checks exact against this golden"
        )
    return note


# ---------------------------------------------------------------------------------- record
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
    records = _select_records(run_dir, steps, phases)
    if records.num_rows == 0:
        raise ValueError(
            f"{run_dir}: no audit records in phases {', '.join(phases)}"
            + ("" if steps is None else f" at steps {steps}")
        )
    present = sorted(set(records["step"].to_pylist()))
    if steps is not None and present != steps:
        missing = sorted(set(steps) - set(present))
        raise ValueError(f"{run_dir}: no audit records at step(s) {missing} in phases {', '.join(phases)}")
    metrics_table = _read_metrics(run_dir)
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


# ---------------------------------------------------------------------------------- check
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


def _bits(value: Any) -> Any:
    """Raw float64 bits of a float (so -0.0 != 0.0 and NaN payloads count); other values as is."""
    if isinstance(value, float):
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    return value


def compare_selection(golden: Golden, run_dir: Path) -> CompareResult:
    """compare_runs(golden, the run restricted to the golden's steps and phases), hashes only."""
    records = _select_records(run_dir, golden.steps, golden.phases)
    with tempfile.TemporaryDirectory(prefix="titan-audit-golden-") as tmp:
        AuditLogWriter(tmp).write(records.select(SCHEMA.names).to_pydict())
        if records.num_rows == 0:  # an empty audit/ still makes a comparable (empty) run
            Path(tmp, "audit").mkdir(exist_ok=True)
        result = compare_runs(golden.path, tmp, with_dumps=False)
    result.run_b = str(run_dir)
    steps = golden.steps
    contiguous = bool(steps) and steps == list(range(steps[0], steps[-1] + 1))
    # filters.steps is compare's [first, last] range (what its report prints); a golden's steps with
    # gaps have no such range, so they are given in full under golden_steps only
    result.filters = {
        "phase": None,
        "names": None,
        "steps": [steps[0], steps[-1]] if contiguous else None,
        "golden_steps": steps,
        "phases": golden.phases,
    }
    result.fingerprint_warnings, result.fingerprint_note = [], None  # the golden check decides the mode
    return result


def _compare_metrics(
    golden: Golden, run_metrics: pa.Table | None, exact: bool
) -> tuple[list[dict[str, Any]], int, list[str]]:
    mismatches: list[dict[str, Any]] = []
    missing: list[str] = []
    points = 0
    for name, bounds in golden.tolerance.metrics.items():
        expected = _metric_values(golden.metrics, name)
        actual = _metric_values(run_metrics, name)
        for step, value in sorted(expected.items()):
            if step not in actual:
                missing.append(f"{name} at step {step}")
                continue
            points += 1
            got = actual[step]
            if exact:
                bad = _bits(got) != _bits(value)
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


def _metric_steps(table: pa.Table | None) -> list[int]:
    return [] if table is None else sorted(set(table["step"].to_pylist()))


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
    run_metrics = _read_metrics(run_dir)
    failures: list[str] = []
    notes: list[str] = []
    compare = None
    if not fp_diff:
        mode = "exact"
        _check_overlap(golden, run_dir)
        compare = compare_selection(golden, run_dir)
        if not compare.identical:
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
                f"(the run's {METRICS} has steps {steps_text(_metric_steps(run_metrics))}): nothing to check"
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


# ---------------------------------------------------------------------------------- update
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
        before, after = _metric_values(old.metrics, name), _metric_values(parts["metrics"], name)
        changed = [s for s in sorted(set(before) | set(after)) if _bits(before.get(s)) != _bits(after.get(s))]
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
