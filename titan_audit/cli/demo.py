"""`titan-audit demo`: the main job (see titan_audit.demo)."""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT


@click.command(short_help="Run the main job: determinism end to end.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where the demo's runs go (new directory; default runs/demo-<UTC time>).")  # fmt: skip
def demo(out: Path | None) -> None:
    """Train, compare, replay elastically, check a golden and decode batch-invariantly; exit 1 if
    any guarantee fails."""
    from titan_audit import demo as demo_job

    if not demo_job.run(out):
        raise SystemExit(EXIT_DIFFERENT)
