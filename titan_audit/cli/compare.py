"""`titan-audit compare RUN_A RUN_B`: are two runs' audit logs identical, and if not, where did they part?

Thin wrapper over `titan_audit.audit.compare.compare_runs`. First, why bitwise equality is not
expected when the configs say so (`audit.config_diff.expected_differences`: a TP layout outside BI
mode), then the config differences (information: the verdict is the records'). Exit 0 identical, 1 different (including
records present in one run only), 2 bad input (also a selection, `--steps`/`--phase`/`--names`,
that selects no record).
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.audit.compare import compare_runs
from titan_audit.audit.config_diff import run_expected_differences
from titan_audit.audit.report import compare_report
from titan_audit.audit.schema import PHASES
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json


@click.command(short_help="Compare two runs' audit logs; name the first divergence.")
@click.argument("run_a", type=click.Path(path_type=Path))
@click.argument("run_b", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--phase", type=click.Choice(PHASES), default=None, help="Compare only this phase.")
@click.option("--names", default=None, metavar="GLOB", help="Compare only records whose name matches GLOB.")
@click.option(
    "--steps", default=None, metavar="FIRST:LAST", help="Compare only these steps (5:8, 5: or :8), e.g. a replay's."
)
def compare(run_a: Path, run_b: Path, as_json: bool, phase: str | None, names: str | None, steps: str | None) -> None:
    """Join RUN_A's and RUN_B's audit records on (step, phase, microbatch, name); exit 1 if any differ."""
    result = compare_runs(run_a, run_b, phase=phase, names=names, steps=steps)
    data = {
        **result.to_dict(),
        "expected_differences": run_expected_differences(run_a, run_b, differed=not result.identical),
    }
    if as_json:
        print_json(data)
    else:
        expected = [
            f"warning: bitwise equality is not expected (comparing anyway): {w}" for w in data["expected_differences"]
        ]
        configs = [f"config differs: {line}" for line in data["config_differences"]]  # first: context for the verdict
        click.echo("\n".join(expected + configs + compare_report(data)))
    if not result.identical:
        raise SystemExit(EXIT_DIFFERENT)
