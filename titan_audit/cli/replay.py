"""`titan-audit replay`: resume a run's checkpoint at another world size and compare (elastic replay)."""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.options import device_option, overwrite_option
from titan_audit.cli.output import print_json


@click.command(short_help="Replay a checkpoint on W ranks; compare bitwise.")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--from-step", "from_step", type=int, required=True, help="The checkpoint step to resume from.")
@click.option("--nproc", type=int, default=1, show_default=True, help="World size W of the replay (dp x tp).")
@click.option("--tp", type=int, default=None, help="Tensor-parallel degree of the replay (default: the run's).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The new run directory.")
@click.option("--verify-to", "verify_to", type=int, default=None, help="Stop (and compare) at this step.")
@device_option(help="Replay on this device (default: the run's); another device computes other bits: a difference.")
@overwrite_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def replay(
    run: Path,
    from_step: int,
    nproc: int,
    tp: int | None,
    out: Path,
    verify_to: int | None,
    device: str | None,
    overwrite: bool | str,
    as_json: bool,
) -> None:
    """Exit 0: identical from the checkpoint on; 1: a difference (first divergence shown); 2: bad input."""
    from titan_audit.trainer.replay import elastic_replay

    try:
        result, to_step = elastic_replay(
            run, from_step, out, nproc=nproc, tp=tp, verify_to=verify_to, overwrite=overwrite, device=device
        )
    except RuntimeError as error:
        raise click.ClickException(str(error)) from None
    verdict = "identical" if result.identical else "different"
    if as_json:
        print_json(
            {
                "verdict": verdict,
                "from_step": from_step,
                "to_step": to_step,
                "world_size": nproc,
                "comparison": result.to_dict(),
            }
        )
    else:
        click.echo(
            f"elastic replay of {run} from step {from_step} to {to_step} on W={nproc}: {verdict.upper()} "
            f"({result.compared} records compared, {result.differing} differ, "
            f"{result.only_in_a + result.only_in_b} in one run only)"
        )
        if result.first_divergence is not None:
            fd = result.first_divergence
            click.echo(
                f"first divergence: step {fd['step']} phase {fd['phase']} microbatch {fd['microbatch']} "
                f"name {fd['name']} ({fd['kind']})"
            )
    if not result.identical:
        raise SystemExit(EXIT_DIFFERENT)
