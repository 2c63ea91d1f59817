"""`titan-audit bench SUITE`: speed as ratios against plain PyTorch in the same run.

A progress bar on stderr while the suite runs (a terminal only: titan_audit/progress.py). With
`--check`: exit 1 when a case missed its target (the JSON's `summary.missed` names them, the
table marks them MISSED), 0 when every target was met, 2 when the suite has no target to check.
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from titan_audit.bench import SUITES, BenchOptions, check_targets, run_suite
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json
from titan_audit.progress import progress_bar


@click.command(short_help="Time a bench suite against plain PyTorch.")
@click.argument("suite", type=click.Choice(sorted(SUITES)))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--quick", is_flag=True, help="Small sizes, for a smoke run (figures not meaningful).")
@click.option("--repeats", default=5, show_default=True, help="Timed batches per side; the minimum counts.")
@click.option(
    "--threads",
    type=int,
    default=None,
    help="Intra-op threads for both sides (default: torch's; suites that pin their own keep them).",
)
@click.option(
    "--generator",
    type=click.Choice(["builtin", "vllm"]),
    default="builtin",
    show_default=True,
    help="Suite generate: the built-in generator, or our model inside vLLM against vLLM's default mode.",
)
@click.option("--check", is_flag=True, help="Exit 1 if a case misses its target (summary.missed names them).")
def bench(
    suite: str, as_json: bool, quick: bool, repeats: int, threads: int | None, generator: str, check: bool
) -> None:
    """Time a suite; ratio = candidate time / baseline time (lower is better)."""
    if generator != "builtin":
        if suite != "generate":
            raise click.UsageError(f"--generator applies to the generate suite only, not {suite!r}")
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()  # one line: how to install the extra (exit 2)
    with progress_bar(f"bench {suite}", unit=" cases") as bar:
        result = run_suite(
            suite, BenchOptions(quick=quick, repeats=repeats, threads=threads, generator=generator), progress=bar.done
        )
    data = result.to_dict()
    if as_json:
        print_json(data)
    else:
        _print_table(suite, data)
    if check and check_targets(result):
        raise SystemExit(EXIT_DIFFERENT)


def _print_table(suite: str, data: dict) -> None:
    table = Table(title=f"bench {suite}: ratio = candidate / baseline time", title_justify="left")
    for column in ("case", "baseline s", "candidate s", "ratio", "target"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for case in data["cases"]:
        mark = {True: "ok", False: "MISSED", None: ""}[case["met_target"]]
        target = f"<= {case['target']:.2f} {mark}" if case["target"] is not None else "-"
        table.add_row(
            case["case"], f"{case['baseline_s']:.3g}", f"{case['candidate_s']:.3g}", f"{case['ratio']:.2f}", target
        )
    Console().print(table)
    for pair in dict.fromkeys((c["baseline"], c["candidate"]) for c in data["cases"]):
        click.echo(f"baseline {pair[0]!r}, candidate {pair[1]!r}")
    summary = data["summary"]
    click.echo(
        f"geomean ratio {summary['geomean_ratio']:.3f}, max {summary['max_ratio']:.3f}, "
        f"targets missed {summary['targets_missed']} of {summary['targets']}"
        + (f": {', '.join(summary['missed'])}" if summary["missed"] else "")
    )
