"""`titan-audit rl` (RL post-training) and `titan-audit verify-onpolicy` (the zero-gap report); rl/ does the work."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.options import device_option, device_override, multinode_options, nproc_option, overwrite_option

_INIT_HELP = (
    "Start from a `titan-audit train` (or rl) run's latest checkpoint or an HF model directory; "
    "default: the deterministic init."
)


_GENERATOR_HELP = (
    "Rollout generator: builtin, or vllm (our model inside vLLM; needs the vllm extra); default: the config's."
)


def _generator_override(generator: str | None) -> list[str]:
    if generator == "vllm":
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()  # one line: how to install the extra (exit 2)
    return [] if generator is None else [f"generator={generator}"]


def _guard(fn):
    """A failed weight sync is a check that found a difference: one line, exit 1."""
    from titan_audit.rl.rollouts import WeightSyncError

    try:
        return fn()
    except WeightSyncError as error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(EXIT_DIFFERENT)


@click.command(short_help="GRPO post-training; rollouts at a deterministic lag.")
@click.option("--config", "source", help="An RL recipe (rl-tiny) or a TOML file; default on --resume: the run's own.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The run directory.")
@click.option("--init", "init", default=None, help=_INIT_HELP)
@nproc_option()
@multinode_options
@click.option("--steps", type=int, default=None, help="Override the config's step count.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@overwrite_option()
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Config override, e.g. rollout.lag=2.")
@click.option("--generator", type=click.Choice(["builtin", "vllm"]), default=None, help=_GENERATOR_HELP)
@device_option()
def rl(
    source, out, init, nproc, nnodes, node_rank, rdzv_endpoint, steps, resume, overwrite, overrides, generator, device
) -> None:
    """RL on verifiable synthetic tasks (see titan_audit/rl/loop.py); no verification overhead."""
    from titan_audit.rl.loop import RL_JOB
    from titan_audit.trainer.launch import LaunchOptions, Rendezvous, start

    rendezvous = Rendezvous.from_options(nnodes, node_rank, rdzv_endpoint, nproc=nproc)
    overrides = [*overrides, *_generator_override(generator), *device_override(device)]
    rc = _guard(
        lambda: start(
            RL_JOB,
            source,
            out,
            nproc=nproc,
            steps=steps,
            overrides=overrides,
            options=LaunchOptions(resume=resume, overwrite=overwrite, init=init),
            rendezvous=rendezvous,
        )
    )
    if rc:
        sys.exit(rc)


@click.command("verify-onpolicy", short_help="RL with the zero-gap check and report; exit 0 iff gap 0.")
@click.option("--config", "source", required=True, help="An RL recipe (rl-tiny) or a TOML file.")
@click.option("--steps", type=int, required=True, help="RL steps to run and verify.")
@click.option(
    "--out", required=True, type=click.Path(path_type=Path), help="The run directory (reports in RUN/reports/)."
)
@click.option("--generator", type=click.Choice(["builtin", "vllm"]), default=None, help=_GENERATOR_HELP)
@click.option(
    "--control",
    "with_control",
    is_flag=True,
    help="Also run the constructed control (RUN/control: the generator is sent weights one ulp off); "
    "it must show a gap, else exit 1.",
)
@click.option(
    "--compare-default",
    is_flag=True,
    help="Also run with native ops (RUN/compare-default) and plot both; reported only, never the verdict.",
)
@click.option("--init", "init", default=None, help=_INIT_HELP)
@nproc_option()
@overwrite_option()
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Config override.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as one JSON object.")
@device_option()
def verify_onpolicy(
    source, steps, out, generator, with_control, compare_default, init, nproc, overwrite, overrides, as_json, device
) -> None:
    """Run RL (batch-invariant mode unless the config turns it off) recording, per step, the
    trainer/generator log-prob gap; write RUN/reports/onpolicy.md and onpolicy.html; exit 0 iff
    the run is in BI mode and the gap is exactly zero at every step (and, with --control, the
    constructed control shows a gap), 1 otherwise. --control repeats the run into RUN/control with
    the generator sent the trainer's weights one ulp off (rl/control.py). --compare-default repeats
    it with native ops into RUN/compare-default: reported, since whether native ops leave a gap
    depends on the CPU's libraries."""
    from titan_audit.rl.verify import verify_onpolicy as verify

    result = _guard(
        lambda: verify(
            source,
            out,
            steps=steps,
            init=init,
            nproc=nproc,
            overwrite=overwrite,
            overrides=[*overrides, *_generator_override(generator), *device_override(device)],
            quiet=as_json,
            control=with_control,
            compare_default=compare_default,
        )
    )
    if result.rc:
        sys.exit(result.rc)
    if as_json:
        from titan_audit.cli.output import print_json

        print_json(result.verdict)
    else:
        from titan_audit.rl.report import control_verdict, gap_verdict

        click.echo(gap_verdict(result.report["summary"]))
        if result.report["control"] is not None:
            click.echo(control_verdict(result.report["control"]))
        click.echo(f"report: {result.report['md']}, {result.report['html']}")
    sys.exit(result.exit_code)
