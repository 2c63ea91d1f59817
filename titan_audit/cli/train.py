"""`titan-audit train`: run or resume a training run (trainer/ does the work)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from titan_audit.cli.options import device_option, device_override, multinode_options, nproc_option, overwrite_option


@click.command(short_help="Train; the same trajectory at every world size.")
@click.option(
    "--config", "source", help="A recipe (tiny-dense, tiny-moe) or a TOML file; default on --resume: the run's own."
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The run directory.")
@click.option(
    "--init",
    "init",
    default=None,
    help="Start from another run's latest checkpoint or an HF model directory (its model shape); "
    "default: the deterministic init.",
)
@nproc_option()
@multinode_options
@click.option("--steps", type=int, default=None, help="Override the config's step count.")
@click.option(
    "--until",
    default=None,
    metavar="SPEC",
    help="Stop at a skill level, at most the config's steps: METRIC>=X or METRIC<=X (reward, accuracy) on "
    "held-out prompts of a built-in RL task, e.g. 'reward>=0.24,task=reversal-short,every=25' "
    "(titan_audit/trainer/until.py); recorded, so a resume keeps it.",
)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@overwrite_option()
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Config override, e.g. optimizer.lr=1e-3.")
@device_option()
def train(
    source: str | None,
    out: Path,
    init: str | None,
    nproc: int | str | None,
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    steps: int | None,
    until: str | None,
    resume: bool,
    overwrite: bool | str,
    overrides: tuple[str, ...],
    device: str | None,
) -> None:
    """Train (tiny recipes run in seconds on a CPU); see docs in titan_audit/trainer/train.py."""
    from titan_audit.trainer.launch import LaunchOptions, Rendezvous, start
    from titan_audit.trainer.train import TRAIN_JOB

    rendezvous = Rendezvous.from_options(nnodes, node_rank, rdzv_endpoint, nproc=nproc)
    rc = start(
        TRAIN_JOB,
        source,
        out,
        nproc=nproc,
        steps=steps,
        overrides=[*overrides, *device_override(device)],
        options=LaunchOptions(resume=resume, overwrite=overwrite, init=init, until=until),
        rendezvous=rendezvous,
    )
    if rc:
        sys.exit(rc)
