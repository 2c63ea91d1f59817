"""`titan-audit compare RUN_A RUN_B`: are two runs' audit logs identical, and if not, where did they part?

Thin wrapper over `titan_audit.audit.compare.compare_runs`. Exit 0 identical, 1 different
(including records present in one run only), 2 bad input.
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.audit.compare import compare_runs
from titan_audit.audit.schema import PHASES
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json

SPREAD_ROWS = 20


@click.command(short_help="Compare two runs' audit logs; name the first divergence.")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--phase", type=click.Choice(PHASES), default=None, help="Compare only this phase.")
@click.option("--names", default=None, metavar="GLOB", help="Compare only records whose name matches GLOB.")
def compare(run_a: Path, run_b: Path, as_json: bool, phase: str | None, names: str | None) -> None:
    """Join RUN_A's and RUN_B's audit records on (step, phase, microbatch, name); exit 1 if any differ."""
    result = compare_runs(run_a, run_b, phase=phase, names=names)
    data = result.to_dict()
    if as_json:
        print_json(data)
    else:
        _print_human(data)
    if not result.identical:
        raise SystemExit(EXIT_DIFFERENT)


def _print_human(data: dict) -> None:
    if data["fingerprint_warnings"]:
        click.echo(
            "warning: the runs have incompatible numerics fingerprints, so bitwise equality is not expected "
            "(comparing anyway): " + "; ".join(data["fingerprint_warnings"])
        )
    if data["fingerprint_note"]:
        click.echo(f"note: {data['fingerprint_note']}")
    click.echo(f"A {data['run_a']}: {data['records_a']} records; B {data['run_b']}: {data['records_b']} records")
    if data["identical"]:
        click.echo(f"identical: {data['compared']} records compared, all hashes equal")
        return
    first = data["first_divergence"]
    where = f"step {first['step']}, phase {first['phase']}, microbatch {first['microbatch']}, name {first['name']}"
    label = {
        "hash": "hashes differ",
        "only_in_a": "recorded in A only",
        "only_in_b": "recorded in B only",
        "conflict_in_a": "recorded more than once in A with different hashes",
        "conflict_in_b": "recorded more than once in B with different hashes",
    }[first["kind"]]
    click.echo(f"first divergence: {where} ({label})")
    for side in ("a", "b"):
        row = first[side]
        if row is not None:
            click.echo(
                f"  {side.upper()}: {row['dtype']}{row['shape']} hash {row['hash']} "
                f"absmax {row['absmax']} mean {row['mean']} (rank {row['rank']})"
            )
    dump = first["dump_diff"]
    if dump is not None and "note" not in dump:
        click.echo(
            f"  dumps: {dump['differing_elements']} of {dump['numel']} elements differ, "
            f"max abs diff {dump['max_abs_diff']}, max ULP {dump['max_ulp']}, first at {dump['first_index']}"
        )
    elif dump is not None:
        click.echo(f"  dumps: {dump['note']}")
    click.echo(
        f"totals: {data['differing']} of {data['compared']} compared records differ; "
        f"{data['only_in_a']} in A only, {data['only_in_b']} in B only; "
        f"keys with conflicting repeats: A {data['conflicts_a']}, B {data['conflicts_b']}"
    )
    click.echo("spread (per step from the first divergence): step differing/compared, A-only, B-only")
    for row in data["spread"][:SPREAD_ROWS]:
        click.echo(f"  {row['step']}: {row['differing']}/{row['compared']}, {row['only_in_a']}, {row['only_in_b']}")
    if len(data["spread"]) > SPREAD_ROWS:
        click.echo(f"  ... {len(data['spread']) - SPREAD_ROWS} more steps (see --json)")
    for side in ("a", "b"):
        examples = data[f"only_in_{side}_examples"]
        if examples:
            shown = ", ".join(f"({e['step']}, {e['phase']}, {e['microbatch']}, {e['name']})" for e in examples[:5])
            click.echo(f"in {side.upper()} only (first {min(5, len(examples))}): {shown}")
