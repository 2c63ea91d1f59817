"""`titan-audit golden kernels`: check this CPU against the kernel golden, record it, add this CPU
to the list it passed on. Thin over `titan_audit.portability`.

Exit codes: 0 every hash reproduced (or recorded); 1 a hash differs (each named: kernel, case,
variant, threads, first differing element with both values where a record here has the golden's
bits), or the variants disagree while recording; 2 bad input: a missing or corrupt golden (named),
an existing golden without --force, a missing or stale battery build, a missing emulator.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json
from titan_audit.portability import kernel_golden


@click.command("kernels", short_help="Check this CPU against the kernel golden (every kernel, variant, thread count).")
@click.option(
    "--golden",
    "golden_path",
    type=click.Path(path_type=Path),
    default=kernel_golden.DEFAULT_PATH,
    show_default=True,
    help="The kernel golden file.",
)
@click.option("--record", "do_record", is_flag=True, help="Write the hashes of this machine instead of checking.")
@click.option("--force", is_flag=True, help="With --record: replace an existing golden (or its section).")
@click.option("--mark-passed", is_flag=True, help="After a passing check, add this CPU to the golden's passed_on list.")
@click.option(
    "--arch",
    type=click.Choice(["native", "aarch64"]),
    default="native",
    show_default=True,
    help="aarch64: the arm64 battery under qemu-user (make battery-aarch64; kernels section only).",
)
@click.option(
    "--section",
    type=click.Choice(["all", "kernels", "torch-ops"]),
    default="all",
    show_default=True,
    help="kernels: the C++ battery (no torch); torch-ops: the BI-mode torch ops.",
)
@click.option(
    "--case", "only", default=None, metavar="PREFIX", help="Check only cases whose kernel/case starts with PREFIX."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def kernels(
    golden_path: Path,
    do_record: bool,
    force: bool,
    mark_passed: bool,
    arch: str,
    section: str,
    only: str | None,
    as_json: bool,
) -> None:
    """Run the kernel battery (and the BI torch ops) and require the golden's hash for every case."""
    if do_record:
        if mark_passed or only:
            raise ValueError("--record takes neither --mark-passed nor --case")
        with Console(stderr=True).status(f"golden kernels: recording {section} ({arch})"):
            summary = kernel_golden.record(golden_path, arch=arch, section=section, force=force)
        if as_json:
            print_json(summary)
        else:
            click.echo("\n".join(kernel_golden.record_report(summary)))
        if not summary["recorded"]:
            raise SystemExit(EXIT_DIFFERENT)
        return
    if force:
        raise ValueError("--force goes with --record")
    with Console(stderr=True).status(f"golden kernels: checking {section} ({arch})"):
        result = kernel_golden.check(golden_path, arch=arch, section=section, only=only)
    if mark_passed and result["passed"]:
        result["marked_passed"] = kernel_golden.mark_passed(golden_path, result)
    if as_json:
        print_json(result)
    else:
        click.echo("\n".join(kernel_golden.check_report(result)))
    if not result["passed"]:
        raise SystemExit(EXIT_DIFFERENT)
