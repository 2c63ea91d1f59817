"""Options several commands share, spelled once."""

from __future__ import annotations

import click

from titan_audit.trainer.run_dir import OVERWRITE_MODES


def overwrite_option(what: str = "a run already in --out"):
    """`--overwrite` (move the old run aside to OUT.replaced-<time>, said in the log) or
    `--overwrite=delete` (remove it); the value reaches the library as "move" / "delete" / False."""
    return click.option(
        "--overwrite",
        type=click.Choice(OVERWRITE_MODES),
        is_flag=False,
        flag_value="move",
        default=None,
        callback=lambda ctx, param, value: value or False,
        help=f"Replace {what}: moved aside to OUT.replaced-<time> (the log says where); =delete removes it.",
    )
