"""Human-readable reports of golden checks and updates (the text `titan-audit golden` prints and
the pytest plugin shows on failure)."""

from __future__ import annotations

from titan_audit.audit.report import compare_report


def record_report(summary: dict) -> str:
    """One line describing a newly recorded golden (`record_golden`'s summary)."""
    return (
        f"recorded golden {summary['golden']}: {summary['records']} audit records, steps "
        f"{_steps_text(summary['steps'])}, phases {','.join(summary['phases'])}, metrics "
        f"{','.join(summary['metrics']) or 'none'}; {summary['bytes']:,} bytes"
    )


def check_report(data: dict) -> list[str]:
    """The human report of a golden check (`GoldenCheck.to_dict()`) as lines."""
    lines: list[str] = []
    verdict = "PASS" if data["passed"] else "FAIL"
    if data["mode"] == "exact":
        lines.append(
            f"{verdict} (mode: exact; numerics fingerprints compatible) run {data['run']} vs golden {data['golden']}"
        )
    else:
        lines.append(f"{verdict} (mode: TOLERANCE, not bitwise) run {data['run']} vs golden {data['golden']}")
        lines.append("  numerics fingerprint fields that differ: " + "; ".join(data["fingerprint_differences"]))
    for line in data["config_differences"]:
        lines.append(f"  warning: config differs: {line}")
    for line in data["notes"]:
        lines.append(f"  note: {line}")
    audit = data["audit"]
    if audit is not None:
        if audit["identical"]:
            lines.append(f"  audit: {audit['compared']} records compared, all hashes equal")
        else:
            lines.extend(compare_report(audit))
    lines.append(
        f"  metrics: {data['metric_points']} points compared"
        + (", bitwise" if data["mode"] == "exact" else f", failure budget {data['max_failures']}")
    )
    for m in data["metric_mismatches"][:10]:
        extra = f" (|diff| {m['abs_diff']:.3g} > bound {m['bound']:.3g})" if "bound" in m else ""
        lines.append(f"    {m['metric']} step {m['step']}: golden {m['golden']!r}, run {m['run']!r}{extra}")
    for line in data["failures"]:
        lines.append(f"  failure: {line}")
    return lines


def changes_report(changes: dict) -> list[str]:
    """The human report of `update_golden`'s changes as lines."""
    lines: list[str] = []
    summary = changes["summary"]
    verb = "updated golden" if changes["rewritten"] else "golden unchanged, not rewritten (--force rewrites it):"
    lines.append(
        f"{verb} {summary['golden']} from {changes['run']}: {summary['records']} audit records, "
        f"{summary['bytes']:,} bytes"
    )
    if changes["previous_corrupt"]:
        lines.append(f"  the previous golden was corrupt ({changes['previous_corrupt']}); nothing to diff against")
        return lines
    fp = changes["fingerprint_changes"]
    lines.append("  numerics fingerprint: " + ("unchanged" if not fp else "changed: " + "; ".join(fp)))
    for key in ("steps", "phases"):
        if changes[key]["before"] != changes[key]["after"]:
            lines.append(f"  {key}: {changes[key]['before']} -> {changes[key]['after']}")
    if changes["tolerance"]["before"] != changes["tolerance"]["after"]:
        lines.append(f"  tolerance: {changes['tolerance']['before']} -> {changes['tolerance']['after']}")
    audit = changes["audit"]
    if audit["identical"]:
        lines.append(f"  audit records: unchanged ({audit['compared']} hashes equal)")
    else:
        first = audit["first_divergence"]
        lines.append(
            f"  audit records: {audit['differing']} of {audit['compared']} hashes changed, {audit['removed']} removed, "
            f"{audit['added']} added; first change at step {first['step']}, phase {first['phase']}, "
            f"microbatch {first['microbatch']}, name {first['name']} ({first['kind']})"
        )
    if not changes["metric_changes"]:
        lines.append("  metrics: unchanged (bitwise)")
    for m in changes["metric_changes"]:
        lines.append(
            f"  metric {m['metric']}: {m['steps_changed']} step(s) changed from step {m['first_step']}, "
            f"max |change| {m['max_abs_change']}"
        )
    return lines


def _steps_text(steps: list[int]) -> str:
    if steps and steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(map(str, steps))
