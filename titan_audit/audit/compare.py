"""Compare two runs' audit logs: identical, or the first divergence in execution order and its spread.

Guarantees:
- Records are joined on the key (step, phase, microbatch, name); `rank` and `seq` are not in the
  key, so runs on different world sizes compare. Two records differ when their hashes (and so
  their dtype, shape or bytes) differ.
- Nothing is ignored: records present in one run only are reported (kind `only_in_a` /
  `only_in_b`), and so are keys that one run recorded more than once with different hashes
  (kind `conflict_in_a` / `conflict_in_b`: e.g. a resumed run that replayed a step differently,
  or two ranks that disagree). Repeated records with the same hash (a faithful replay) count once.
- The first divergence is the earliest of all those events in execution order: step, then
  phase in `schema.PHASES` order, then microbatch, then `seq` (the order the recording rank
  produced the records in, i.e. module execution order within the phase).
- `spread` counts, for every step from the first divergence on, how many records differ, how
  many are in one run only, and how many were compared.
- When both runs dumped the first differing tensor (RUN/dumps.zarr), `dump_diff` gives the
  number of differing elements, the max abs diff and the max ULP distance (audit.tensor_diff).
- When both runs have a manifest with a numerics fingerprint and the fingerprints are not
  compatible, `fingerprint_warnings` says why bitwise equality is not expected; the comparison
  still runs.
- `steps=(first, last)` (CLI `--steps FIRST:LAST`, either end may be left open) compares only the
  records of steps first..last in both runs; records outside the range are not loaded, so a replay
  that holds only the steps after its checkpoint compares with its source run without the early
  steps counting as `only_in_a`. `parse_steps` turns the CLI text into the pair (ValueError naming
  the value). The range is reported under `filters.steps` ([first, last], null for an open end).
- `config_differences` lists, before anything else, the keys in which the two runs' configs (their
  manifests' `config`) differ, as "key: A's value -> B's value" (audit.config_diff, the same rule as
  `golden check`: keys that never change the bits of a step are left out). Information only: the
  verdict is the records'.
- An empty selection is bad input, never "identical": when neither run holds a record under the
  filters (or at all), a ValueError names the selection and what the runs hold (their steps, phases
  or record names), so a typo in `--steps`, `--phase` or `--names` cannot pass as a green check.
- Bad input (missing directory, a directory without an audit log, an unreadable part) raises
  ValueError naming the path (for a damaged part: the part file).
"""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from titan_audit.audit.config_diff import change_text, config_changes
from titan_audit.audit.dumps import has_dump, read_dump
from titan_audit.audit.log import read_audit_log
from titan_audit.audit.run_manifest import MANIFEST, read_manifest
from titan_audit.audit.schema import KEY, PHASES, check_phase
from titan_audit.audit.tensor_diff import tensor_diff
from titan_audit.log import get_logger

log = get_logger(__name__)

Key = tuple[int, str, int, str]
_VALUE_COLUMNS = ("hash", "dtype", "shape", "absmax", "mean", "rank", "seq")
EXAMPLES = 20
# which kind names a key that is several: a conflict explains a hash difference, not the reverse
_KIND_PRIORITY = ("conflict_in_a", "conflict_in_b", "differing", "only_in_a", "only_in_b")


@dataclass
class CompareResult:
    run_a: str
    run_b: str
    filters: dict[str, Any]
    records_a: int
    records_b: int
    compared: int
    differing: int
    only_in_a: int
    only_in_b: int
    conflicts_a: int
    conflicts_b: int
    first_divergence: dict[str, Any] | None
    spread: list[dict[str, int]]
    only_in_a_examples: list[dict[str, Any]]
    only_in_b_examples: list[dict[str, Any]]
    fingerprint_warnings: list[str] = field(default_factory=list)
    fingerprint_note: str | None = None
    config_differences: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Stable keys; non-finite floats as the strings "nan"/"inf"/"-inf" (JSON has none)."""
        return _json_safe(
            {
                "identical": self.identical,
                "run_a": self.run_a,
                "run_b": self.run_b,
                "filters": self.filters,
                "records_a": self.records_a,
                "records_b": self.records_b,
                "compared": self.compared,
                "differing": self.differing,
                "only_in_a": self.only_in_a,
                "only_in_b": self.only_in_b,
                "conflicts_a": self.conflicts_a,
                "conflicts_b": self.conflicts_b,
                "first_divergence": self.first_divergence,
                "spread": self.spread,
                "only_in_a_examples": self.only_in_a_examples,
                "only_in_b_examples": self.only_in_b_examples,
                "fingerprint_warnings": self.fingerprint_warnings,
                "fingerprint_note": self.fingerprint_note,
                "config_differences": self.config_differences,
                "phase_order": list(PHASES),
            }
        )


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


StepRange = tuple[int | None, int | None]


def parse_steps(text: str) -> StepRange:
    """'FIRST:LAST', 'FIRST:' or ':LAST' (inclusive, integers >= 0, FIRST <= LAST) or 'N' (one step)."""
    parts = text.split(":")
    if len(parts) > 2 or not text.strip() or text.strip() == ":":
        raise ValueError(f"--steps {text!r}: expected FIRST:LAST (e.g. 5:8, 5: or :8) or one step N")
    values: list[int | None] = []
    for part in parts:
        part = part.strip()
        if not part:
            values.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"--steps {text!r}: {part!r} is not a step number") from None
        if value < 0:
            raise ValueError(f"--steps {text!r}: step {value} is negative")
        values.append(value)
    first, last = (values[0], values[0]) if len(values) == 1 else (values[0], values[1])
    if first is not None and last is not None and first > last:
        raise ValueError(f"--steps {text!r}: FIRST {first} is after LAST {last}")
    return first, last


def _load(run_dir: Path, phase: str | None, names: str | None, steps: StepRange = (None, None)) -> pa.Table:
    expr = None if phase is None else ds.field("phase") == phase
    for bound, keep in ((steps[0], lambda v: ds.field("step") >= v), (steps[1], lambda v: ds.field("step") <= v)):
        if bound is not None:
            term = keep(bound)
            expr = term if expr is None else expr & term
    table = read_audit_log(run_dir, columns=list(KEY + _VALUE_COLUMNS), filter=expr)
    if names is not None:
        unique = pc.unique(table["name"]).to_pylist()
        keep = pa.array([n for n in unique if fnmatch.fnmatchcase(n, names)], type=pa.string())
        table = table.filter(pc.is_in(table["name"], value_set=keep))
    log.debug(
        "%s: %d audit records (phase %s, names %s, steps %s..%s)",
        run_dir,
        table.num_rows,
        phase or "any",
        names or "any",
        "first" if steps[0] is None else steps[0],
        "last" if steps[1] is None else steps[1],
    )
    return table


def _dedup(table: pa.Table) -> pa.Table:
    """One row per key. Repeats with the same hash collapse; `n_hashes` > 1 marks a conflict
    (the row's values are then those of the smallest hash; the hashes are listed separately)."""
    keys = table.group_by(list(KEY)).aggregate([])
    if keys.num_rows == table.num_rows:  # the usual case: every key once, nothing to collapse
        return table.append_column("n_hashes", pa.array([1] * table.num_rows, type=pa.int64()))
    grouped = table.group_by(list(KEY), use_threads=False).aggregate(
        [("hash", "min"), ("hash", "count_distinct")] + [(c, "min") for c in _VALUE_COLUMNS if c != "hash"]
    )
    renamed = {f"{c}_min": c for c in _VALUE_COLUMNS} | {"hash_count_distinct": "n_hashes"}
    return grouped.rename_columns([renamed.get(n, n) for n in grouped.column_names])


def _conflicting_hashes(table: pa.Table, key: Key) -> list[str]:
    mask = None
    for column, value in zip(KEY, key):
        term = pc.equal(table[column], value)
        mask = term if mask is None else pc.and_(mask, term)
    return list(dict.fromkeys(table.filter(mask)["hash"].to_pylist()))


def _side_row(row: dict[str, Any], suffix: str) -> dict[str, Any] | None:
    if row[f"hash{suffix}"] is None:
        return None
    return {c: row[f"{c}{suffix}"] for c in _VALUE_COLUMNS}


def _sorted(table: pa.Table) -> pa.Table:
    """Rows in execution order: step, phase order, microbatch, seq (then name, for ties)."""
    rank = pc.fill_null(pc.index_in(table["phase"], value_set=pa.array(PHASES)), len(PHASES))
    seq = pc.coalesce(table["seq_a"], table["seq_b"])
    table = table.append_column("_phase_rank", rank).append_column("_seq", seq)
    order = [
        ("step", "ascending"),
        ("_phase_rank", "ascending"),
        ("phase", "ascending"),
        ("microbatch", "ascending"),
        ("_seq", "ascending"),
        ("name", "ascending"),
    ]
    return table.sort_by(order)


def _key_dict(key: Key) -> dict[str, Any]:
    return dict(zip(KEY, key))


def _read_fingerprint(run_dir: Path) -> dict[str, Any] | None:
    if not (run_dir / MANIFEST).is_file():
        return None
    fp = read_manifest(run_dir).get("fingerprint")
    return fp if isinstance(fp, dict) and "fingerprint_version" in fp else None


def fingerprint_check(run_a: Path, run_b: Path) -> tuple[list[str], str | None]:
    """(reasons bitwise equality is not expected, note when fingerprints could not be checked)."""
    from titan_audit.deterministic import NumericsFingerprint, incompatibilities

    fa, fb = _read_fingerprint(run_a), _read_fingerprint(run_b)
    if fa is None or fb is None:
        missing = [str(r) for r, f in ((run_a, fa), (run_b, fb)) if f is None]
        return [], f"no numerics fingerprint in the manifest of {', '.join(missing)}; compatibility not checked"
    a = NumericsFingerprint.from_dict(fa, source=str(run_a / MANIFEST))
    b = NumericsFingerprint.from_dict(fb, source=str(run_b / MANIFEST))
    return incompatibilities(a, b), None


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    if not (run_dir / MANIFEST).is_file():
        return None
    config = read_manifest(run_dir).get("config")
    return config if isinstance(config, dict) else None


def config_differences(run_a: str | os.PathLike, run_b: str | os.PathLike) -> list[str]:
    """The config keys in which two runs differ, "key: A's value -> B's value" (audit.config_diff;
    keys that never change the bits of a step left out); [] when either run has no config."""
    config_a, config_b = _read_config(Path(run_a)), _read_config(Path(run_b))
    if config_a is None or config_b is None:
        return []
    return [change_text(change) for change in config_changes(config_a, config_b)]


def steps_text(steps: list[int]) -> str:
    """[1, 2, 3, 7, 8] -> '1..3, 7..8'; [] -> 'none'."""
    if not steps:
        return "none"
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in runs)


def _range_text(steps: StepRange) -> str:
    first, last = steps
    if first is not None and first == last:
        return str(first)
    return f"{'' if first is None else first}:{'' if last is None else last}"


def _holds(what: str, a: str, b: str) -> str:
    return f"A and B have {what} {a}" if a == b else f"A has {what} {a}, B has {what} {b}"


def empty_selection_message(run_a: Path, run_b: Path, *, phase: str | None, names: str | None, steps: StepRange) -> str:
    """Why no record of either run is selected: the filter(s) that select nothing, and what exists."""
    cols = ["step", "phase", "name"]
    all_a, all_b = read_audit_log(run_a, columns=cols), read_audit_log(run_b, columns=cols)
    if all_a.num_rows == 0 and all_b.num_rows == 0:
        return f"{run_a} and {run_b} hold no audit records: nothing to compare"

    def phase_order(p: str) -> tuple[int, str]:
        return (PHASES.index(p) if p in PHASES else len(PHASES), p)

    held = {
        side: {
            "step": sorted(set(pc.unique(table["step"]).to_pylist())),
            "phase": sorted(set(pc.unique(table["phase"]).to_pylist()), key=phase_order),
            "name": sorted(set(pc.unique(table["name"]).to_pylist())),
        }
        for side, table in (("a", all_a), ("b", all_b))
    }
    both = {
        k: sorted(set(held["a"][k]) | set(held["b"][k]), key=phase_order if k == "phase" else None) for k in held["a"]
    }
    lo, hi = steps
    filters = {
        "steps": (
            None
            if steps == (None, None)
            else (
                f"--steps {_range_text(steps)}",
                lambda r: (lo is None or r >= lo) and (hi is None or r <= hi),
                "step",
            )
        ),
        "phase": None if phase is None else (f"--phase {phase}", lambda p: p == phase, "phase"),
        "names": None if names is None else (f"--names {names!r}", lambda n: fnmatch.fnmatchcase(n, names), "name"),
    }
    given = {k: f for k, f in filters.items() if f is not None}
    step_clause = _holds("steps", steps_text(held["a"]["step"]), steps_text(held["b"]["step"]))
    phase_clause = _holds("phases", ", ".join(held["a"]["phase"]) or "none", ", ".join(held["b"]["phase"]) or "none")
    clauses = []
    for key, (text, keep, column) in given.items():
        if any(keep(v) for v in both[column]):
            continue
        if key == "steps":
            clauses.append(f"{text} selects no records: {step_clause}")
        elif key == "phase":
            clauses.append(f"{text} selects no records: {phase_clause}")
        else:
            shown = ", ".join(both["name"][:6])
            clauses.append(f"{text} matches no record name; names look like: {shown} ({len(both['name'])} names)")
    if clauses:
        return "; ".join(clauses)
    selection = " ".join(text for text, _, _ in given.values())
    return f"{selection} select no records together (each matches some on its own): {step_clause}; {phase_clause}"


def _check_run(run_dir: Path) -> None:
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory (expected a run directory)")
    if not (run_dir / "audit").is_dir():
        raise ValueError(f"{run_dir}: not a run with an audit log (audit/ not found)")


FLAGS = ("compared", "differing", "only_in_a", "only_in_b", "conflict_in_a", "conflict_in_b")


def _join(raw_a: pa.Table, raw_b: pa.Table) -> pa.Table:
    """The two runs' records joined on the key, one row per key, with int64 0/1 columns `_<flag>`
    for each of FLAGS: in both runs (compared), in both with different hashes (differing), in one
    run only, recorded more than once with different hashes in a run (conflict_in_a / _b)."""
    joined = _dedup(raw_a).join(
        _dedup(raw_b), keys=list(KEY), join_type="full outer", left_suffix="_a", right_suffix="_b"
    )
    in_a, in_b = pc.is_valid(joined["hash_a"]), pc.is_valid(joined["hash_b"])
    both = pc.and_(in_a, in_b)
    flags = {
        "compared": both,
        "differing": pc.fill_null(pc.and_(both, pc.not_equal(joined["hash_a"], joined["hash_b"])), False),
        "only_in_a": pc.and_(in_a, pc.invert(in_b)),
        "only_in_b": pc.and_(in_b, pc.invert(in_a)),
        "conflict_in_a": pc.fill_null(pc.greater(joined["n_hashes_a"], 1), False),
        "conflict_in_b": pc.fill_null(pc.greater(joined["n_hashes_b"], 1), False),
    }
    assert tuple(flags) == FLAGS
    for name, flag in flags.items():
        joined = joined.append_column(f"_{name}", pc.cast(flag, pa.int64()))
    return joined


def joined_records(run_a: str | os.PathLike, run_b: str | os.PathLike) -> pa.Table:
    """Every audit key of two runs, joined as `compare_runs` joins them (see `_join`): columns
    KEY, `hash_a`, `hash_b` and the `_<flag>` columns of FLAGS."""
    run_a, run_b = Path(run_a), Path(run_b)
    _check_run(run_a)
    _check_run(run_b)
    return _join(_load(run_a, None, None), _load(run_b, None, None))


def compare_runs(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    *,
    phase: str | None = None,
    names: str | None = None,
    with_dumps: bool = True,
    steps: StepRange | str | None = None,
) -> CompareResult:
    """Compare two runs' audit logs (see the module docstring)."""
    run_a, run_b = Path(run_a), Path(run_b)
    _check_run(run_a)
    _check_run(run_b)
    if phase is not None:
        check_phase(phase)
    step_range: StepRange = parse_steps(steps) if isinstance(steps, str) else (steps or (None, None))
    first, last = step_range
    if first is not None and last is not None and first > last:
        raise ValueError(f"steps ({first}, {last}): first is after last")
    warnings, note = fingerprint_check(run_a, run_b)
    config_diff = config_differences(run_a, run_b)
    raw_a, raw_b = _load(run_a, phase, names, step_range), _load(run_b, phase, names, step_range)
    if raw_a.num_rows == 0 and raw_b.num_rows == 0:
        raise ValueError(empty_selection_message(run_a, run_b, phase=phase, names=names, steps=step_range))
    joined = _join(raw_a, raw_b)
    counts = {name: int(pc.sum(joined[f"_{name}"]).as_py() or 0) for name in FLAGS}
    differ, only_a, only_b = (pc.cast(joined[f"_{n}"], pa.bool_()) for n in ("differing", "only_in_a", "only_in_b"))
    conflict_a, conflict_b = (pc.cast(joined[f"_{n}"], pa.bool_()) for n in ("conflict_in_a", "conflict_in_b"))

    event = pc.or_(pc.or_(pc.or_(differ, only_a), pc.or_(only_b, conflict_a)), conflict_b)
    events = _sorted(joined.filter(event))
    first = None
    spread: list[dict[str, int]] = []
    if events.num_rows:
        row = events.slice(0, 1).to_pylist()[0]
        kind = next(k for k in _KIND_PRIORITY if row[f"_{k}"])
        kind = "hash" if kind == "differing" else kind
        first = _describe(kind, row, raw_a, raw_b, run_a, run_b, with_dumps)
        later = joined.filter(pc.greater_equal(joined["step"], row["step"]))
        counted = ("compared", "differing", "only_in_a", "only_in_b")
        per_step = later.group_by("step").aggregate([(f"_{n}", "sum") for n in counted])
        spread = sorted(
            ({"step": r["step"], **{n: r[f"_{n}_sum"] for n in counted}} for r in per_step.to_pylist()),
            key=lambda r: r["step"],
        )
    examples = {}
    for side, flag in (("a", only_a), ("b", only_b)):
        rows = _sorted(joined.filter(flag)).slice(0, EXAMPLES).select(list(KEY)).to_pylist()
        examples[side] = rows
    return CompareResult(
        run_a=str(run_a),
        run_b=str(run_b),
        filters={"phase": phase, "names": names, "steps": None if step_range == (None, None) else list(step_range)},
        records_a=raw_a.num_rows,
        records_b=raw_b.num_rows,
        compared=counts["compared"],
        differing=counts["differing"],
        only_in_a=counts["only_in_a"],
        only_in_b=counts["only_in_b"],
        conflicts_a=counts["conflict_in_a"],
        conflicts_b=counts["conflict_in_b"],
        first_divergence=first,
        spread=spread,
        only_in_a_examples=examples["a"],
        only_in_b_examples=examples["b"],
        fingerprint_warnings=warnings,
        fingerprint_note=note,
        config_differences=config_diff,
    )


def _describe(
    kind: str, row: dict[str, Any], raw_a: pa.Table, raw_b: pa.Table, run_a: Path, run_b: Path, with_dumps: bool
) -> dict[str, Any]:
    key: Key = tuple(row[c] for c in KEY)  # type: ignore[assignment]
    out: dict[str, Any] = {"kind": kind, **_key_dict(key)}
    for label, raw in (("a", raw_a), ("b", raw_b)):
        side = _side_row(row, f"_{label}")
        if side is not None and (row[f"n_hashes_{label}"] or 0) > 1:
            side["conflicting_hashes"] = _conflicting_hashes(raw, key)
        out[label] = side
    out["dump_diff"] = None
    if with_dumps and kind == "hash" and has_dump(run_a, *key) and has_dump(run_b, *key):
        ta, tb = read_dump(run_a, *key), read_dump(run_b, *key)
        if ta.dtype == tb.dtype and ta.shape == tb.shape:
            out["dump_diff"] = tensor_diff(ta, tb).to_dict()
        else:
            out["dump_diff"] = {"note": f"dtype/shape differ: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"}
    return out
