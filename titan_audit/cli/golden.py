"""`titan-audit golden record|check|update|kernels`: keep a run as a golden, check runs against it, refresh it.

Thin wrappers over `titan_audit.golden`. Exit codes: 0 ok (check: the run matches, and the output
says in which mode), 1 the check found a difference (or only tolerance mode was possible under
--require-exact), 2 bad input: a missing directory, a directory that is not a golden or not a run,
a golden from a newer format version, and a corrupt golden (a file whose size or sha256 does not
match golden.json): corruption is bad input, never reported as a numerics mismatch. Also bad input:
`record`/`update` of a run a live process is still writing, `update` by a run of another model
(both unless --force), and `check` of a run holding none of the golden's steps.
"""

from __future__ import annotations

from pathlib import Path

import click

from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.lazy_group import LazyGroup
from titan_audit.cli.output import print_json
from titan_audit.golden import check_golden, parse_steps, record_golden, update_golden
from titan_audit.golden.report import changes_report, check_report, record_report
from titan_audit.golden.selection import parse_phases


def _bounds(values: tuple[str, ...], option: str) -> dict[str, float]:
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"{option} {item!r}: expected METRIC=NUMBER")
    return out


def _selection_options(fn):
    options = [
        click.option("--steps", default=None, metavar="SPEC", help="Steps to keep, e.g. 1-4,8 (default: all)."),
        click.option(
            "--phases",
            default=None,
            metavar="LIST",
            help="Comma-separated audit phases to keep (default: rollout,data,logprob,loss,grad,optim,param).",
        ),
        click.option(
            "--metrics",
            default=None,
            metavar="LIST",
            help="Comma-separated metrics.parquet columns to keep and check "
            "(default: loss,grad_norm,lr,aux_loss where present).",
        ),
        click.option("--rtol", multiple=True, metavar="METRIC=X", help="Tolerance-mode relative bound (repeatable)."),
        click.option("--atol", multiple=True, metavar="METRIC=X", help="Tolerance-mode absolute bound (repeatable)."),
        click.option(
            "--max-failures",
            type=int,
            default=None,
            help="Tolerance-mode failure budget: (metric, step) points allowed outside bounds (default 0).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _selection(steps, phases, metrics, rtol, atol) -> dict:
    return {
        "steps": parse_steps(steps),
        "phases": parse_phases(phases),
        "metrics": None if metrics is None else [m.strip() for m in metrics.split(",") if m.strip()],
        "rtol": _bounds(rtol, "--rtol"),
        "atol": _bounds(atol, "--atol"),
    }


# `golden kernels` (cli/portability.py) is imported only when it runs
KERNELS = "Check this CPU against the kernel golden (every kernel, variant, thread count)."


@click.group(
    cls=LazyGroup,
    lazy={"kernels": ("titan_audit.cli.portability:kernels", KERNELS)},
    short_help="Golden runs: record, check (exact or tolerance), update.",
)
def golden() -> None:
    """Golden runs: a small, verified subset of a run (audit hashes, metrics, numerics fingerprint)."""


@golden.command(short_help="Keep a run's audit records and metrics as a new golden.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@_selection_options
@click.option("--force", is_flag=True, help="Record even while a live process is still writing RUN.")
def record(
    run: Path, golden_dir: Path, steps, phases, metrics, rtol, atol, max_failures, as_json: bool, force: bool
) -> None:
    """Write GOLDEN_DIR from RUN; refuses an existing GOLDEN_DIR (use `golden update`) and a run still being written."""
    summary = record_golden(
        run,
        golden_dir,
        **_selection(steps, phases, metrics, rtol, atol),
        max_failures=max_failures or 0,
        force=force,
    )
    if as_json:
        print_json(summary)
        return
    click.echo(record_report(summary))


@golden.command(short_help="Check a run against a golden; name the first divergence.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@click.option("--require-exact", is_flag=True, help="Fail (exit 1) when only tolerance mode is possible.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def check(run: Path, golden_dir: Path, require_exact: bool, as_json: bool) -> None:
    """Exact (hashes, raw metric bits) when the numerics fingerprints match; tolerance mode on metrics otherwise."""
    result = check_golden(run, golden_dir, require_exact=require_exact)
    if as_json:
        print_json(result.to_dict())
    else:
        click.echo("\n".join(check_report(result.to_dict())))
    if not result.passed:
        raise SystemExit(EXIT_DIFFERENT)


@golden.command(short_help="Replace a golden by a new run, deliberately; print what changed.")
@click.argument("run", type=click.Path(path_type=Path))
@click.argument("golden_dir", type=click.Path(path_type=Path))
@_selection_options
@click.option(
    "--force",
    is_flag=True,
    help="Rewrite even when nothing compared would change (refreshes the manifest), when the model "
    "differs from the golden's, or while a live process is still writing RUN.",
)
def update(
    run: Path, golden_dir: Path, steps, phases, metrics, rtol, atol, max_failures, as_json: bool, force: bool
) -> None:
    """Rewrite GOLDEN_DIR from RUN (keeping its steps, phases and tolerances unless given); refuses
    a run of another model or one still being written unless --force."""
    changes = update_golden(
        run, golden_dir, **_selection(steps, phases, metrics, rtol, atol), max_failures=max_failures, force=force
    )
    if as_json:
        print_json(changes)
        return
    click.echo("\n".join(changes_report(changes)))
