"""`titan-audit verify RUN`: read every part of a run's audit log in full and check it.

Thin wrapper over `titan_audit.audit.log.verify_log`: each part's Parquet page checksums and
schema, its size and xxh3-128 digest against the index (RUN/audit/_index/), and every index entry
against a part that exists. A resume reads only the newest parts; this reads them all. Reads
only. Exit 0 intact, 1 a problem found (each named, one line each), 2 bad input (no such run, no
audit log). `--json` prints one object: run, ok, parts, records, bytes, indexed, unindexed,
problems.
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.audit.log import verify_log
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json


@click.command(short_help="Read a run's whole audit log back against its index.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def verify(run: Path, as_json: bool) -> None:
    """Read every part of RUN's audit log in full (page checksums, digests in the index); exit 1 on a problem."""
    result = verify_log(run)
    if as_json:
        print_json(result.to_dict())
    else:
        index = "checked against the index" if result.indexed else "no index (a run written before it)"
        state = "intact" if result.ok else f"{len(result.problems)} problem(s)"
        read = f"{result.parts} parts, {result.records} records, {result.bytes} bytes"
        lines = [f"{run}: audit log {state}: {read}; {index}"]
        if result.unindexed:
            lines.append(f"{len(result.unindexed)} part(s) after the index (the next resume indexes them)")
        click.echo("\n".join(lines + result.problems))
    if not result.ok:
        raise SystemExit(EXIT_DIFFERENT)
