"""`titan-audit export`: a run's checkpoint as an HF model directory (trainer/export.py does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.options import overwrite_option


@click.command(short_help="Write a run's checkpoint as an HF model directory.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--step", type=int, default=None, help="The checkpoint step to export; default: the newest.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The HF model directory to write.")
@overwrite_option("a directory already in --out")
@click.option("--json", "as_json", is_flag=True, help="Print path, run, step, files and weights digest as JSON.")
def export(run: Path, step: int | None, out: Path, overwrite: bool | str, as_json: bool) -> None:
    """Write checkpoint --step of RUN (verified against its hashes) to --out: config.json,
    model.safetensors (float32) and generation_config.json, which
    transformers.AutoModelForCausalLM.from_pretrained loads with our logits."""
    from titan_audit.trainer.export import export_run

    result = export_run(run, out, step=step, overwrite=overwrite)
    if as_json:
        from titan_audit.cli.output import print_json

        print_json(result.to_dict())
    else:
        click.echo(f"exported {run} step {result.step} to {result.path}: {', '.join(result.files)}")
        click.echo(f"weights {result.weights}")
