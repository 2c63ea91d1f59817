"""`titan-audit golden record|check|update`: keep a run as a golden, check runs against it, refresh it.

Thin wrappers over `titan_audit.golden`. Exit codes: 0 ok (check: the run matches, and the output
says in which mode), 1 the check found a difference (or only tolerance mode was possible under
--require-exact), 2 bad input: a missing directory, a directory that is not a golden or not a run,
a golden from a newer format version, and a corrupt golden (a file whose size or sha256 does not
match golden.json): corruption is bad input, never reported as a numerics mismatch.
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.compare import _print_human as print_compare
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json
from titan_audit.golden import check_golden, parse_steps, record_golden, update_golden
from titan_audit.golden.check import parse_phases


def _bounds(values: tuple[str, ...], option: str) -> dict[str, float]:
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"{option} {item!r}: expected METRIC=NUMBER")
    return out


def _selection_options(fn):
    options = [
        click.option("--steps", default=None, metavar="SPEC", help="Steps to keep, e.g. 1-4,8 (default: all)."),
        click.option("--phases", default=None, metavar="LIST",
                     help="Comma-separated audit phases to keep (default: rollout,data,logprob,loss,grad,optim,param)."),
        click.option("--metrics", default=None, metavar="LIST",
                     help="Comma-separated metrics.parquet columns to keep and check (default: loss,grad_norm,lr)."),
        click.option("--rtol", multiple=True, metavar="METRIC=X", help="Tolerance-mode relative bound (repeatable)."),
        click.option("--atol", multiple=True, metavar="METRIC=X", help="Tolerance-mode absolute bound (repeatable)."),
        click.option("--max-failures", type=int, default=None,
                     help="Tolerance-mode failure budget: (metric, step) points allowed outside bounds (default 0)."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def _selection(steps, phases, metrics, rtol, atol) -> dict:
    return {
        "steps": parse_steps(steps),
        "phases": parse_phases(phases),
        "metrics": None if metrics is None else [m.strip() for m in metrics.split(",") if m.strip()],
        "rtol": _bounds(rtol, "--rtol"),
        "atol": _bounds(atol, "--atol"),
    }


@click.group(short_help="Golden runs: record, check (exact or tolerance), update.")
def golden() -> None:
    """Golden runs: a small, verified subset of a run (audit hashes, metrics, numerics fingerprint)."""


@golden.command(short_help="Keep a run's audit records and metrics as a new golden.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@_selection_options
def record(run: Path, golden_dir: Path, steps, phases, metrics, rtol, atol, max_failures, as_json: bool) -> None:
    """Write GOLDEN_DIR from RUN; refuses an existing GOLDEN_DIR (use `golden update`)."""
    summary = record_golden(run, golden_dir, **_selection(steps, phases, metrics, rtol, atol),
                            max_failures=max_failures or 0)  # fmt: skip
    if as_json:
        print_json(summary)
        return
    click.echo(f"recorded golden {summary['golden']}: {summary['records']} audit records, steps "
               f"{_steps_text(summary['steps'])}, phases {','.join(summary['phases'])}, metrics "
               f"{','.join(summary['metrics']) or 'none'}; {summary['bytes']:,} bytes")  # fmt: skip


@golden.command(short_help="Check a run against a golden; name the first divergence.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@click.option("--require-exact", is_flag=True, help="Fail (exit 1) when only tolerance mode is possible.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def check(run: Path, golden_dir: Path, require_exact: bool, as_json: bool) -> None:
    """Exact (hashes, raw metric bits) when the numerics fingerprints match; tolerance mode on metrics otherwise."""
    result = check_golden(run, golden_dir, require_exact=require_exact)
    if as_json:
        print_json(result.to_dict())
    else:
        print_check(result.to_dict())
    if not result.passed:
        raise SystemExit(EXIT_DIFFERENT)


def print_check(data: dict) -> None:
    verdict = "PASS" if data["passed"] else "FAIL"
    if data["mode"] == "exact":
        click.echo(f"{verdict} (mode: exact; numerics fingerprints compatible) run {data['run']} vs golden {data['golden']}")
    else:
        click.echo(f"{verdict} (mode: TOLERANCE, not bitwise) run {data['run']} vs golden {data['golden']}")
        click.echo("  numerics fingerprint fields that differ: " + "; ".join(data["fingerprint_differences"]))
    for line in data["config_differences"]:
        click.echo(f"  warning: config differs: {line}")
    for line in data["notes"]:
        click.echo(f"  note: {line}")
    audit = data["audit"]
    if audit is not None:
        if audit["identical"]:
            click.echo(f"  audit: {audit['compared']} records compared, all hashes equal")
        else:
            print_compare(audit)
    click.echo(f"  metrics: {data['metric_points']} points compared"
               + (", bitwise" if data["mode"] == "exact" else f", failure budget {data['max_failures']}"))  # fmt: skip
    for m in data["metric_mismatches"][:10]:
        extra = f" (|diff| {m['abs_diff']:.3g} > bound {m['bound']:.3g})" if "bound" in m else ""
        click.echo(f"    {m['metric']} step {m['step']}: golden {m['golden']!r}, run {m['run']!r}{extra}")
    for line in data["failures"]:
        click.echo(f"  failure: {line}")


@golden.command(short_help="Replace a golden by a new run, deliberately; print what changed.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@_selection_options
@click.option("--force", is_flag=True, help="Rewrite even when nothing compared would change (refreshes the manifest).")
def update(run: Path, golden_dir: Path, steps, phases, metrics, rtol, atol, max_failures, as_json: bool, force: bool) -> None:
    """Rewrite GOLDEN_DIR from RUN (keeping its steps, phases and tolerances unless given)."""
    changes = update_golden(run, golden_dir, **_selection(steps, phases, metrics, rtol, atol),
                            max_failures=max_failures, force=force)  # fmt: skip
    if as_json:
        print_json(changes)
        return
    print_changes(changes)


def print_changes(changes: dict) -> None:
    summary = changes["summary"]
    verb = "updated golden" if changes["rewritten"] else "golden unchanged, not rewritten (--force rewrites it):"
    click.echo(f"{verb} {summary['golden']} from {changes['run']}: {summary['records']} audit records, "
               f"{summary['bytes']:,} bytes")  # fmt: skip
    if changes["previous_corrupt"]:
        click.echo(f"  the previous golden was corrupt ({changes['previous_corrupt']}); nothing to diff against")
        return
    fp = changes["fingerprint_changes"]
    click.echo("  numerics fingerprint: " + ("unchanged" if not fp else "changed: " + "; ".join(fp)))
    for key in ("steps", "phases"):
        if changes[key]["before"] != changes[key]["after"]:
            click.echo(f"  {key}: {changes[key]['before']} -> {changes[key]['after']}")
    if changes["tolerance"]["before"] != changes["tolerance"]["after"]:
        click.echo(f"  tolerance: {changes['tolerance']['before']} -> {changes['tolerance']['after']}")
    audit = changes["audit"]
    if audit["identical"]:
        click.echo(f"  audit records: unchanged ({audit['compared']} hashes equal)")
    else:
        first = audit["first_divergence"]
        click.echo(f"  audit records: {audit['differing']} of {audit['compared']} hashes changed, {audit['removed']} removed, "
                   f"{audit['added']} added; first change at step {first['step']}, phase {first['phase']}, "
                   f"microbatch {first['microbatch']}, name {first['name']} ({first['kind']})")  # fmt: skip
    if not changes["metric_changes"]:
        click.echo("  metrics: unchanged (bitwise)")
    for m in changes["metric_changes"]:
        click.echo(f"  metric {m['metric']}: {m['steps_changed']} step(s) changed from step {m['first_step']}, "
                   f"max |change| {m['max_abs_change']}")  # fmt: skip


def _steps_text(steps: list[int]) -> str:
    if steps and steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ",".join(map(str, steps))
