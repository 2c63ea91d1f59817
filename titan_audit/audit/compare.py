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
- Bad input (missing directory, a directory without an audit log, an unreadable part) raises
  ValueError naming the path.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds

from titan_audit.audit.dumps import has_dump, read_dump
from titan_audit.audit.log import read_audit_log
from titan_audit.audit.schema import KEY, PHASE_RANK, PHASES, check_phase
from titan_audit.audit.tensor_diff import tensor_diff

Key = tuple[int, str, int, str]
_VALUE_COLUMNS = ("hash", "dtype", "shape", "absmax", "mean", "rank", "seq")
EXAMPLES = 20


@dataclass
class _Side:
    """One run's records: key -> row (first occurrence), plus keys recorded with several hashes."""

    rows: dict[Key, dict[str, Any]]
    conflicts: dict[Key, list[str]]
    total: int


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

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Stable keys; non-finite floats as the strings "nan"/"inf"/"-inf" (JSON has none)."""
        return _json_safe({
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
            "phase_order": list(PHASES),
        })


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _load(run_dir: Path, phase: str | None, names: str | None) -> _Side:
    expr = None if phase is None else ds.field("phase") == phase
    table = read_audit_log(run_dir, columns=list(KEY + _VALUE_COLUMNS), filter=expr)
    if names is not None:
        unique = pc.unique(table["name"]).to_pylist()
        keep = [n for n in unique if fnmatch.fnmatchcase(n, names)]
        table = table.filter(pc.is_in(table["name"], value_set=_string_array(keep)))
    cols = table.to_pydict()
    rows: dict[Key, dict[str, Any]] = {}
    conflicts: dict[Key, list[str]] = {}
    for i in range(table.num_rows):
        key = (cols["step"][i], cols["phase"][i], cols["microbatch"][i], cols["name"][i])
        row = rows.get(key)
        if row is None:
            rows[key] = {c: cols[c][i] for c in _VALUE_COLUMNS}
        elif row["hash"] != cols["hash"][i]:
            seen = conflicts.setdefault(key, [row["hash"]])
            if cols["hash"][i] not in seen:
                seen.append(cols["hash"][i])
    return _Side(rows, conflicts, table.num_rows)


def _string_array(values: list[str]):
    import pyarrow as pa

    return pa.array(values, type=pa.string())


def _order(key: Key, seq: int) -> tuple:
    step, phase, microbatch, name = key
    return (step, PHASE_RANK.get(phase, len(PHASES)), phase, microbatch, seq, name)


def _key_dict(key: Key) -> dict[str, Any]:
    return dict(zip(KEY, key))


def _read_fingerprint(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    fp = manifest.get("fingerprint") if isinstance(manifest, dict) else None
    return fp if isinstance(fp, dict) and "fingerprint_version" in fp else None


def fingerprint_check(run_a: Path, run_b: Path) -> tuple[list[str], str | None]:
    """(reasons bitwise equality is not expected, note when fingerprints could not be checked)."""
    from titan_audit.deterministic import NumericsFingerprint, incompatibilities

    fa, fb = _read_fingerprint(run_a), _read_fingerprint(run_b)
    if fa is None or fb is None:
        missing = [str(r) for r, f in ((run_a, fa), (run_b, fb)) if f is None]
        return [], f"no numerics fingerprint in the manifest of {', '.join(missing)}; compatibility not checked"
    a = NumericsFingerprint.from_dict(fa, source=str(run_a / "manifest.json"))
    b = NumericsFingerprint.from_dict(fb, source=str(run_b / "manifest.json"))
    return incompatibilities(a, b), None


def _check_run(run_dir: Path) -> None:
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory (expected a run directory)")
    if not (run_dir / "audit").is_dir():
        raise ValueError(f"{run_dir}: not a run with an audit log (audit/ not found)")


def compare_runs(
    run_a: str | os.PathLike,
    run_b: str | os.PathLike,
    *,
    phase: str | None = None,
    names: str | None = None,
    with_dumps: bool = True,
) -> CompareResult:
    """Compare two runs' audit logs (see the module docstring)."""
    run_a, run_b = Path(run_a), Path(run_b)
    _check_run(run_a)
    _check_run(run_b)
    if phase is not None:
        check_phase(phase)
    warnings, note = fingerprint_check(run_a, run_b)
    a, b = _load(run_a, phase, names), _load(run_b, phase, names)

    events: list[tuple[tuple, str, Key]] = []
    compared = differing = 0
    per_step: dict[int, dict[str, int]] = defaultdict(lambda: {"compared": 0, "differing": 0, "only_in_a": 0, "only_in_b": 0})
    for key, row_a in a.rows.items():
        row_b = b.rows.get(key)
        if row_b is None:
            events.append((_order(key, row_a["seq"]), "only_in_a", key))
            per_step[key[0]]["only_in_a"] += 1
            continue
        compared += 1
        per_step[key[0]]["compared"] += 1
        if row_a["hash"] != row_b["hash"]:
            differing += 1
            per_step[key[0]]["differing"] += 1
            events.append((_order(key, row_a["seq"]), "hash", key))
    only_b = [key for key in b.rows if key not in a.rows]
    for key in only_b:
        events.append((_order(key, b.rows[key]["seq"]), "only_in_b", key))
        per_step[key[0]]["only_in_b"] += 1
    for side, label in ((a, "conflict_in_a"), (b, "conflict_in_b")):
        for key in side.conflicts:
            events.append((_order(key, side.rows[key]["seq"]), label, key))
    events.sort(key=lambda e: e[0])

    first = None
    spread: list[dict[str, int]] = []
    if events:
        _, kind, key = events[0]
        first = _describe(kind, key, a, b, run_a, run_b, with_dumps)
        spread = [{"step": step, **counts} for step, counts in sorted(per_step.items()) if step >= key[0]]
    only_a_keys = sorted((k for k in a.rows if k not in b.rows), key=lambda k: _order(k, a.rows[k]["seq"]))
    only_b_keys = sorted(only_b, key=lambda k: _order(k, b.rows[k]["seq"]))
    return CompareResult(
        run_a=str(run_a),
        run_b=str(run_b),
        filters={"phase": phase, "names": names},
        records_a=a.total,
        records_b=b.total,
        compared=compared,
        differing=differing,
        only_in_a=len(only_a_keys),
        only_in_b=len(only_b_keys),
        conflicts_a=len(a.conflicts),
        conflicts_b=len(b.conflicts),
        first_divergence=first,
        spread=spread,
        only_in_a_examples=[_key_dict(k) for k in only_a_keys[:EXAMPLES]],
        only_in_b_examples=[_key_dict(k) for k in only_b_keys[:EXAMPLES]],
        fingerprint_warnings=warnings,
        fingerprint_note=note,
    )


def _describe(kind: str, key: Key, a: _Side, b: _Side, run_a: Path, run_b: Path, with_dumps: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, **_key_dict(key)}
    for label, side in (("a", a), ("b", b)):
        row = side.rows.get(key)
        out[label] = None if row is None else {c: row[c] for c in _VALUE_COLUMNS}
        if row is not None and key in side.conflicts:
            out[label]["conflicting_hashes"] = side.conflicts[key]
    out["dump_diff"] = None
    if with_dumps and kind == "hash" and has_dump(run_a, *key) and has_dump(run_b, *key):
        ta, tb = read_dump(run_a, *key), read_dump(run_b, *key)
        if ta.dtype == tb.dtype and ta.shape == tb.shape:
            out["dump_diff"] = tensor_diff(ta, tb).to_dict()
        else:
            out["dump_diff"] = {"note": f"dtype/shape differ: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"}
    return out
