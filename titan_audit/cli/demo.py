"""`titan-audit demo`: the main job (see titan_audit.demo); its terminal view is titan_audit.cli.demo_view."""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT


@click.command(short_help="The main job: every guarantee proven here; a report.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the demo's runs go (new directory; default runs/demo-<UTC time>).",
)
@click.option("--quick", is_flag=True, help="Fewer steps and smaller checks (under a minute); still every guarantee.")
@click.pass_context
def demo(ctx: click.Context, out: Path | None, quick: bool) -> None:
    """Train on 2 ranks and 1, replay a checkpoint, kill -9 and resume, RL with the zero-gap check,
    batch-invariance spot-checks, committed goldens; a verdict table and OUT/reports/report.html.
    Exit 1 if any guarantee fails (-v: every stage's output)."""
    from titan_audit.cli.demo_view import DemoView
    from titan_audit.demo import run

    verbose = bool(ctx.obj and ctx.obj.get("verbose"))
    with DemoView() as view:
        result = run(out, quick=quick, verbose=verbose, listener=view)
        view.finish(result)
    if not result.passed:
        raise SystemExit(EXIT_DIFFERENT)
