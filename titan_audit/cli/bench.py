"""`titan-audit bench SUITE`: speed as ratios against plain PyTorch in the same run."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from titan_audit.bench import SUITES, BenchOptions, run_suite
from titan_audit.cli.output import print_json


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
def bench(suite: str, as_json: bool, quick: bool, repeats: int, threads: int | None, generator: str) -> None:
    """Time a suite; ratio = candidate time / baseline time (lower is better)."""
    if generator != "builtin":
        if suite != "generate":
            raise click.UsageError(f"--generator applies to the generate suite only, not {suite!r}")
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()  # one line: how to install the extra (exit 2)
    err = Console(stderr=True)
    with err.status(f"bench {suite}") as status:
        result = run_suite(
            suite,
            BenchOptions(quick=quick, repeats=repeats, threads=threads, generator=generator),
            progress=lambda case: status.update(f"bench {suite}: done {case}"),
        )
    data = result.to_dict()
    if as_json:
        print_json(data)
        return
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
        f"targets missed {summary['targets_missed']}"
    )
