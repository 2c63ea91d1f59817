"""The `titan-audit` click group; each command lives in its own module, imported when it runs.

`titan-audit --help` lists the commands from `COMMANDS` without importing them (no torch), and
`titan-audit CMD ...` imports CMD's module alone (cli/lazy_group.py). A new command is one line
in `COMMANDS`."""

from __future__ import annotations

import os

import click

from titan_audit import __version__
from titan_audit.cli.lazy_group import LazyGroup
from titan_audit.log import VERBOSE_ENV, configure

# name -> ("module:command", its short help): imported only when the command runs (cli/lazy_group.py)
COMMANDS = {
    "export": ("titan_audit.cli.export:export", "Write a run's checkpoint as an HF model directory."),
    "env": ("titan_audit.cli.env:env", "Print the numerics fingerprint of this machine."),
    "bench": ("titan_audit.cli.bench:bench", "Time a bench suite against plain PyTorch."),
    "compare": ("titan_audit.cli.compare:compare", "Compare two runs' audit logs; name the first divergence."),
    "verify": ("titan_audit.cli.verify:verify", "Read a run's whole audit log back against its index."),
    "bisect": ("titan_audit.cli.bisect:bisect", "First aten op at which two DebugMode op logs differ."),
    "data": ("titan_audit.cli.data:data", "Tokenize, synthesize and inspect training data."),
    "demo": ("titan_audit.cli.demo:demo", "The main job: every guarantee proven here; a report."),
    "golden": ("titan_audit.cli.golden:golden", "Golden runs: record, check (exact or tolerance), update."),
    "train": ("titan_audit.cli.train:train", "Train; the same trajectory at every world size."),
    "replay": ("titan_audit.cli.replay:replay", "Replay a checkpoint on W ranks; compare bitwise."),
    "report": ("titan_audit.cli.report:report", "The run report: one HTML file (plots embedded) + Markdown."),
    "rl": ("titan_audit.cli.rl:rl", "GRPO post-training; rollouts at a deterministic lag."),
    "verify-onpolicy": (
        "titan_audit.cli.rl:verify_onpolicy",
        "RL with the zero-gap check and report; exit 0 iff gap 0.",
    ),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="titan-audit")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help=f"Every rank logs, at DEBUG (also {VERBOSE_ENV}=1); tracebacks for errors. Logs go to stderr.",
)
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Bitwise-reproducible training and RL post-training, and the audits that prove it."""
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # the ranks torchrun starts inherit it and configure() reads it
    configure(bool(verbose))


def main() -> None:
    cli(prog_name="titan-audit")
