"""Human-readable reports of run comparisons (the text `titan-audit compare` prints).

Kept in the library, not the CLI, so that other front ends (golden checks, the pytest plugin)
print the same words; the JSON form is `CompareResult.to_dict()`.
"""

from __future__ import annotations

SPREAD_ROWS = 20


def compare_report(data: dict) -> list[str]:
    """The human report of `CompareResult.to_dict()` as lines (what `titan-audit compare` prints)."""
    lines: list[str] = []
    if data["fingerprint_warnings"]:
        lines.append(
            "warning: the runs have incompatible numerics fingerprints, so bitwise equality is not expected "
            "(comparing anyway): " + "; ".join(data["fingerprint_warnings"])
        )
    if data["fingerprint_note"]:
        lines.append(f"note: {data['fingerprint_note']}")
    steps = (data.get("filters") or {}).get("steps")
    if steps is None:
        only = ""
    else:
        first = "first" if steps[0] is None else steps[0]
        last = "last" if steps[1] is None else steps[1]
        only = f" (steps {first}..{last} only)"
    lines.append(
        f"A {data['run_a']}: {data['records_a']} records; B {data['run_b']}: {data['records_b']} records{only}"
    )
    if data["identical"]:
        lines.append(f"identical: {data['compared']} records compared, all hashes equal")
        return lines
    first = data["first_divergence"]
    where = f"step {first['step']}, phase {first['phase']}, microbatch {first['microbatch']}, name {first['name']}"
    label = {
        "hash": "hashes differ",
        "only_in_a": "recorded in A only",
        "only_in_b": "recorded in B only",
        "conflict_in_a": "recorded more than once in A with different hashes",
        "conflict_in_b": "recorded more than once in B with different hashes",
    }[first["kind"]]
    lines.append(f"first divergence: {where} ({label})")
    for side in ("a", "b"):
        row = first[side]
        if row is not None:
            lines.append(
                f"  {side.upper()}: {row['dtype']}{row['shape']} hash {row['hash']} "
                f"absmax {row['absmax']} mean {row['mean']} (rank {row['rank']})"
            )
    dump = first["dump_diff"]
    if dump is not None and "note" not in dump:
        lines.append(
            f"  dumps: {dump['differing_elements']} of {dump['numel']} elements differ, "
            f"max abs diff {dump['max_abs_diff']}, max ULP {dump['max_ulp']}, first at {dump['first_index']}"
        )
    elif dump is not None:
        lines.append(f"  dumps: {dump['note']}")
    lines.append(
        f"totals: {data['differing']} of {data['compared']} compared records differ; "
        f"{data['only_in_a']} in A only, {data['only_in_b']} in B only; "
        f"keys with conflicting repeats: A {data['conflicts_a']}, B {data['conflicts_b']}"
    )
    lines.append("spread (per step from the first divergence): step differing/compared, A-only, B-only")
    for row in data["spread"][:SPREAD_ROWS]:
        lines.append(f"  {row['step']}: {row['differing']}/{row['compared']}, {row['only_in_a']}, {row['only_in_b']}")
    if len(data["spread"]) > SPREAD_ROWS:
        lines.append(f"  ... {len(data['spread']) - SPREAD_ROWS} more steps (see --json)")
    for side in ("a", "b"):
        examples = data[f"only_in_{side}_examples"]
        if examples:
            shown = ", ".join(f"({e['step']}, {e['phase']}, {e['microbatch']}, {e['name']})" for e in examples[:5])
            lines.append(f"in {side.upper()} only (first {min(5, len(examples))}): {shown}")
    return lines
