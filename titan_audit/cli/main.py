"""The `titan-audit` click group; each command lives in its own module."""

from __future__ import annotations

import os

import click

from titan_audit import __version__
from titan_audit.cli.bench import bench
from titan_audit.cli.bisect import bisect
from titan_audit.cli.compare import compare
from titan_audit.cli.data import data
from titan_audit.cli.demo import demo
from titan_audit.cli.env import env
from titan_audit.cli.errors import AuditGroup
from titan_audit.cli.export import export
from titan_audit.cli.golden import golden
from titan_audit.cli.portability import kernels as golden_kernels
from titan_audit.cli.replay import replay
from titan_audit.cli.report import report
from titan_audit.cli.rl import rl, verify_onpolicy
from titan_audit.cli.train import train
from titan_audit.log import VERBOSE_ENV, configure


@click.group(cls=AuditGroup, context_settings={"help_option_names": ["-h", "--help"]})
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


cli.add_command(env)
cli.add_command(bench)
cli.add_command(compare)
cli.add_command(bisect)
cli.add_command(data)
cli.add_command(demo)
golden.add_command(golden_kernels)  # titan-audit golden kernels
cli.add_command(golden)
cli.add_command(train)
cli.add_command(replay)
cli.add_command(report)
cli.add_command(rl)
cli.add_command(verify_onpolicy)
cli.add_command(export)


def main() -> None:
    cli(prog_name="titan-audit")
