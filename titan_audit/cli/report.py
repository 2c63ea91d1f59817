"""`titan-audit report RUN [--against RUN_B] [--open]`: the self-contained HTML run report (report/ does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.output import print_json


@click.command(short_help="The run report: one HTML file (plots embedded) + Markdown.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option(
    "--against",
    "against",
    type=click.Path(path_type=Path),
    default=None,
    help="Also compare with this run: the divergence map (steps x modules/phases that differ).",
)
@click.option("--open", "open_", is_flag=True, help="Open the HTML report in the default web browser.")
@click.option("--json", "as_json", is_flag=True, help="Print the report paths as one JSON object.")
def report(run: Path, against: Path | None, open_: bool, as_json: bool) -> None:
    """For a train, rl or demo directory: loss/reward curves, zero-gap table and plot, audit coverage,
    replays and verdicts; exit 2 if RUN is not a run directory."""
    from titan_audit.report import write_report

    paths = write_report(run, against)
    if as_json:
        print_json(paths)
    else:
        click.echo(f"report ({paths['kind']} run): {paths['html']}  (markdown: {paths['md']})")
    if open_:
        import webbrowser

        webbrowser.open(Path(paths["html"]).resolve().as_uri())
