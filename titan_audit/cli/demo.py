"""`titan-audit demo`: the main job (see titan_audit.demo)."""

from __future__ import annotations

import click

from titan_audit.cli.errors import EXIT_DIFFERENT


@click.command(short_help="Run the main job: determinism end to end.")
def demo() -> None:
    """Show determinism end to end on a tiny model; exit 1 if any check fails."""
    from titan_audit import demo as demo_job

    if not demo_job.run():
        raise SystemExit(EXIT_DIFFERENT)
