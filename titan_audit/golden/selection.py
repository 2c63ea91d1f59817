"""What a golden compares in a run: the selection of steps and phases, the run's records and
metric values of that selection, and the numerics provenance (fingerprints, BI kernel versions,
config keys) that decides between exact and tolerance mode.

Guarantees:
- `parse_steps` / `parse_phases` turn the CLI's selections into sorted steps and known phases
  (ValueError naming the bad part otherwise);
- records are filtered while reading (a run may be large), and a metrics file with a step twice
  is refused (ValueError) rather than read one way or the other;
- `float_bits` is how values are compared in exact mode: the raw float64 bits (-0.0 != +0.0,
  NaN payloads count), never a tolerance;
- `compare_selection` compares the golden with the run restricted to the golden's steps and
  phases, hash for hash, through `audit.compare_runs`;
- `fingerprint_differences` is empty iff the fingerprints are compatible (exact mode is valid);
  `kernels_change` names a BI-kernel version change, so a failure it causes is not blamed on the run.
"""

from __future__ import annotations

import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from titan_audit.audit import config_diff
from titan_audit.audit.compare import CompareResult, compare_runs
from titan_audit.audit.log import AuditLogWriter, read_audit_log
from titan_audit.audit.run_metrics import METRICS, read_metrics
from titan_audit.audit.schema import SCHEMA, check_phase
from titan_audit.golden.store import Golden


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


def select_records(run_dir: Path, steps: list[int] | None, phases: list[str]) -> pa.Table:
    """The run's records in `phases` (and `steps`), filtered while reading (a run may be large)."""
    expr = ds.field("phase").isin(pa.array(phases, type=pa.string()))
    if steps is not None:
        expr = expr & ds.field("step").isin(pa.array(steps, type=pa.int64()))
    return read_audit_log(run_dir, filter=expr)


def read_run_metrics(run_dir: Path) -> pa.Table | None:
    table = read_metrics(run_dir)
    if table is None:
        return None
    steps = table["step"].to_pylist()
    if len(set(steps)) != len(steps):
        raise ValueError(f"{run_dir / METRICS}: a step appears more than once")
    return table


def metric_values(table: pa.Table | None, name: str) -> dict[int, Any]:
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


def float_bits(value: Any) -> Any:
    """Raw float64 bits of a float (so -0.0 != 0.0 and NaN payloads count); other values as is."""
    if isinstance(value, float):
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    return value


def compare_selection(golden: Golden, run_dir: Path) -> CompareResult:
    """compare_runs(golden, the run restricted to the golden's steps and phases), hashes only."""
    records = select_records(run_dir, golden.steps, golden.phases)
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


def metric_steps(table: pa.Table | None) -> list[int]:
    return [] if table is None else sorted(set(table["step"].to_pylist()))
