"""`titan-audit train`: run or resume a training run (trainer/ does the work)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from titan_audit.cli.errors import UserError


@click.command(short_help="Train with a trajectory that is the same at every world size.")
@click.option("--config", "source", help="A recipe (tiny-dense, tiny-moe) or a TOML file; default on --resume: the run's own.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The run directory.")
@click.option("--nproc", type=int, default=None, help="Launch N local ranks through torchrun.")
@click.option("--steps", type=int, default=None, help="Override the config's step count.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--overwrite", is_flag=True, help="Move a run already in --out aside and start anew.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Config override, e.g. optimizer.lr=1e-3.")
def train(source: str | None, out: Path, nproc: int | None, steps: int | None, resume: bool, overwrite: bool,
          overrides: tuple[str, ...]) -> None:  # fmt: skip
    """Train (tiny recipes run in seconds on a CPU); see docs in titan_audit/trainer/train.py."""
    from titan_audit.trainer.config import from_dict, load_config
    from titan_audit.trainer.launch import launch
    from titan_audit.trainer.run_dir import read_manifest
    from titan_audit.trainer.train import check_run_dir
    from titan_audit.trainer.typed_config import apply_overrides

    extra = [*overrides, *([f"steps={steps}"] if steps is not None else [])]
    if source is None:
        if not resume:
            raise UserError("--config is required (a recipe name or a TOML file) unless --resume")
        config = from_dict(apply_overrides(read_manifest(out)["config"], extra), f"{out}/manifest.json config")
    else:
        config = load_config(source, extra)
    world_size = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    if int(os.environ.get("RANK", "0")) == 0:
        check_run_dir(config, out, resume=resume, overwrite=overwrite, world_size=world_size)
    rc = launch(config, out, nproc=nproc, resume=resume, overwrite=overwrite)
    if rc:
        sys.exit(rc)
