"""`titan-audit bisect A B`: the first aten op at which two recorded DebugMode op logs part.

A and B are op-log files (`RUN/oplogs/<label>.parquet`, written by
`titan_audit.audit.oplog.record_op_log`) or run directories holding one. With `--step N` and two
run directories, a run without a recorded log for step N has that step re-run from its latest
checkpoint before N, on one rank, under DebugMode (`titan_audit.trainer.op_bisect`; the runs are
only read). Thin wrapper over `compare_op_logs` / `bisect_step`: the first differing op, its phase
(forward, backward, optimizer, other) and what its inputs say (`cause`: tensor inputs already
different, a scalar argument that differs, or identical inputs: the op is not reproducible).
Exit 0 identical, 1 different, 2 bad input (also two op logs without a single op).
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.audit.oplog import compare_op_logs, find_op_log
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json


@click.command(short_help="First aten op at which two DebugMode op logs differ.")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option(
    "--step",
    type=int,
    default=None,
    help="Step N: the runs' oplogs/step_N.parquet, else step N re-run from their checkpoints.",
)
@click.option("--log", "label", default=None, metavar="NAME", help="Use oplogs/NAME.parquet of each run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bisect(a: Path, b: Path, step: int | None, label: str | None, as_json: bool) -> None:
    """Compare two op logs (files, or run directories holding them); exit 1 if they differ."""
    if step is not None and label is None and a.is_dir() and b.is_dir():
        from titan_audit.trainer.op_bisect import bisect_step  # the trainer loads only when needed

        result = bisect_step(a, b, step)
    else:
        result = compare_op_logs(find_op_log(a, label, step), find_op_log(b, label, step))
    data = result.to_dict()
    if as_json:
        print_json(data)
    elif result.identical:
        click.echo(f"identical: {data['ops_a']} ops, every output hash equal")
    elif data["kind"] == "structure":
        click.echo(f"the op sequences part at op #{data['index']}: {data['op']} (module {data['module'] or '-'})")
        click.echo(f"  A: {data['call_a']}\n  B: {data['call_b']}")
    else:
        where = f"in module {data['module']}" if data["module"] else "outside any module"
        click.echo(f"first differing op: #{data['index']} {data['op']} {where} ({data['phase']}); {data['cause']}")
        click.echo(f"  call: {data['call_a']}")
        if data["differing_scalars"]:
            click.echo(f"  call in B: {data['call_b']}")
        click.echo(f"  {data['differing_ops']} of {data['ops_a']} ops have differing outputs")
    if not result.identical:
        raise SystemExit(EXIT_DIFFERENT)
