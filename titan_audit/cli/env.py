"""`titan-audit env`: print this machine's numerics fingerprint (and check it against a saved one)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json, print_mapping
from titan_audit.deterministic import NumericsFingerprint, fingerprint, incompatibilities


@click.command(short_help="Print the numerics fingerprint of this machine.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--against",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A fingerprint saved with `env --json`: exit 1 if this machine cannot match it bitwise.",
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when present).")
def env(as_json: bool, against: Path | None, device: str | None) -> None:
    """Print the numerics fingerprint: what decides the bits on this machine."""
    here = fingerprint(device)
    reasons = None
    if against is not None:
        reasons = incompatibilities(NumericsFingerprint.from_dict(_read_json(against), source=str(against)), here)
    if as_json:
        out = here.to_dict()
        if reasons is not None:
            out = {"fingerprint": out, "against": str(against), "compatible": not reasons, "reasons": reasons}
        print_json(out)
    else:
        print_mapping("numerics fingerprint", here.to_dict())
        if reasons is not None:
            if reasons:
                click.echo(f"not bitwise-comparable with {against}:")
                for reason in reasons:
                    click.echo(f"  {reason}")
            else:
                click.echo(f"bitwise-comparable with {against}")
    if reasons:
        raise SystemExit(EXIT_DIFFERENT)


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
