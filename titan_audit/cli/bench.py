"""`titan-audit bench SUITE`: speed as ratios against plain PyTorch in the same run.

`bench memory` measures bytes, not time: peak live tensor bytes per rank against the formula of
docs/memory.md (ratio = measured / formula), with its grid from --modes, --world-sizes,
--microbatches, --model and --memory-steps (bench/memory_suite.py).

A progress bar on stderr while the suite runs (a terminal only: titan_audit/progress.py). With
`--check`: exit 1 when a case missed its target (the JSON's `summary.missed` names them, the
table marks them MISSED), 0 when every target was met, 2 when the suite has no target to check.
With `--save`: the JSON also goes to `benchmarks/results/SUITE-KIND-DATE-COMMIT.json`
(bench/results.py), from which scripts/perf_tables.py makes the performance tables.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from titan_audit.bench import SUITES, BenchOptions, check_targets, run_suite
from titan_audit.bench.core import MemoryGrid
from titan_audit.bench.memory_suite import QUICK_GRID
from titan_audit.bench.results import RESULTS_DIR, save_result
from titan_audit.cli.errors import EXIT_DIFFERENT
from titan_audit.cli.output import print_json
from titan_audit.progress import progress_bar


@click.command(short_help="Time a bench suite against plain PyTorch.")
@click.argument("suite", type=click.Choice(sorted(SUITES)))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--quick", is_flag=True, help="Small sizes, for a smoke run (figures not meaningful).")
@click.option("--repeats", default=5, show_default=True, help="Timed batches per side; the minimum counts.")
@click.option(
    "--threads",
    type=int,
    default=None,
    help="Intra-op threads for both sides (default: torch's; suites that pin their own keep them).",
)
@click.option(
    "--generator",
    type=click.Choice(["builtin", "vllm"]),
    default="builtin",
    show_default=True,
    help="Suite generate: the built-in generator, or our model inside vLLM against vLLM's default mode.",
)
@click.option("--check", is_flag=True, help="Exit 1 if a case misses its target (summary.missed names them).")
@click.option(
    "--save",
    is_flag=True,
    help="Also write the JSON to --results-dir as SUITE-KIND-DATE-COMMIT.json (never replacing a file).",
)
@click.option(
    "--results-dir",
    type=click.Path(path_type=Path),
    default=RESULTS_DIR,
    show_default=True,
    help="Where --save writes.",
)
@click.option("--notes", default="", help="With --save: what the figures need beside them (load, options).")
@click.option("--modes", help="Suite memory: parallel modes, comma-separated (default dp,fsdp).")
@click.option("--world-sizes", help="Suite memory: W values, comma-separated (default 1,2,4).")
@click.option("--microbatches", help="Suite memory: V values, comma-separated (default 2,4,8,16).")
@click.option("--model", type=click.Choice(["50m", "tiny"]), help="Suite memory: the model (default 50m).")
@click.option("--memory-steps", type=int, help="Suite memory: training steps per point (default 2).")
def bench(
    suite: str,
    as_json: bool,
    quick: bool,
    repeats: int,
    threads: int | None,
    generator: str,
    check: bool,
    save: bool,
    results_dir: Path,
    notes: str,
    **memory: str | int | None,
) -> None:
    """Time a suite; ratio = candidate time / baseline time (lower is better). Suite memory:
    ratio = measured peak bytes / the formula's."""
    if generator != "builtin":
        if suite != "generate":
            raise click.UsageError(f"--generator applies to the generate suite only, not {suite!r}")
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()  # one line: how to install the extra (exit 2)
    options = BenchOptions(
        quick=quick, repeats=repeats, threads=threads, generator=generator, memory=_memory_grid(suite, quick, memory)
    )
    with progress_bar(f"bench {suite}", unit=" cases") as bar:
        result = run_suite(suite, options, progress=bar.done)
    data = result.to_dict()
    if save:
        saved = save_result(data, results_dir, options=dataclasses.asdict(options), notes=notes)
        click.echo(f"saved: {saved}", err=True)
    if as_json:
        print_json(data)
    elif suite == "memory":
        _print_memory_table(data)
    else:
        _print_table(suite, data)
    if check and check_targets(result):
        raise SystemExit(EXIT_DIFFERENT)


def _print_table(suite: str, data: dict) -> None:
    table = Table(title=f"bench {suite}: ratio = candidate / baseline time", title_justify="left")
    for column in ("case", "baseline s", "candidate s", "ratio", "target"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for case in data["cases"]:
        mark = {True: "ok", False: "MISSED", None: ""}[case["met_target"]]
        target = f"<= {case['target']:.2f} {mark}" if case["target"] is not None else "-"
        seconds = [
            f"{case[k]:.3g}" if k in case else "-" for k in ("baseline_s", "candidate_s")
        ]  # a bytes case has none
        table.add_row(case["case"], *seconds, f"{case['ratio']:.2f}", target)
    Console().print(table)
    for pair in dict.fromkeys((c["baseline"], c["candidate"]) for c in data["cases"]):
        click.echo(f"baseline {pair[0]!r}, candidate {pair[1]!r}")
    summary = data["summary"]
    click.echo(
        f"geomean ratio {summary['geomean_ratio']:.3f}, max {summary['max_ratio']:.3f}, "
        f"targets missed {summary['targets_missed']} of {summary['targets']}"
        + (f": {', '.join(summary['missed'])}" if summary["missed"] else "")
    )


def _memory_grid(suite: str, quick: bool, given: dict[str, str | int | None]) -> MemoryGrid | None:
    """The memory grid from the --modes ... --memory-steps options (None when none is given: the
    suite's default, or its quick grid); a UsageError for them with another suite."""
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if suite != "memory":
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise click.UsageError(f"{flags} apply to the memory suite only, not {suite!r}")
    defaults = QUICK_GRID if quick else MemoryGrid()
    fields = {}
    for key in ("modes", "world_sizes", "microbatches"):
        if key in given:
            items = [x.strip() for x in str(given[key]).split(",") if x.strip()]
            try:
                fields[key] = tuple(items) if key == "modes" else tuple(int(x) for x in items)
            except ValueError:
                raise click.BadParameter(
                    f"expected comma-separated numbers, got {given[key]!r}", param_hint=f"--{key.replace('_', '-')}"
                ) from None
    if "model" in given:
        fields["model"] = given["model"]
    if "memory_steps" in given:
        fields["steps"] = given["memory_steps"]
    try:
        return dataclasses.replace(defaults, **fields)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _print_memory_table(data: dict) -> None:
    table = Table(
        title="bench memory: peak live tensor bytes per rank (max over ranks), GB = 1e9 bytes", title_justify="left"
    )
    for column in ("case", "formula GB", "measured GB", "ratio", "target", "peak RSS GB", "exchange GB"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for case in data["cases"]:
        mark = {True: "ok", False: "MISSED", None: ""}[case["met_target"]]
        low = case.get("target_low")
        band = f"{low:.2f}-{case['target']:.2f}" if low is not None else f"<= {case['target']:.2f}"
        rss = case.get("max_rss_bytes")
        exchange = case.get("exchange_mapped_bytes")
        table.add_row(
            case["case"],
            _gb(case["baseline_bytes"]),
            _gb(case["candidate_bytes"]),
            f"{case['ratio']:.3f}",
            f"{band} {mark}",
            _gb(rss) if rss is not None else "-",
            _gb(exchange) if exchange else "-",
        )
    Console().print(table)
    summary = data["summary"]
    click.echo(
        "RSS with the memory policy off; exchange: the same-host /dev/shm file (once per host, mapped by every rank). "
        f"Targets missed {summary['targets_missed']} of {summary['targets']}"
        + (f": {', '.join(summary['missed'])}" if summary["missed"] else "")
    )
