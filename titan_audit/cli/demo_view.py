"""How `titan-audit demo` looks in a terminal (the command: titan_audit.cli.demo).

The job (`titan_audit.demo.run`) reports to a `Listener`; `DemoView` is the rich one: a
progress bar (the stage running, steps done, time), the stage titles, each verdict as it comes,
with -v every stage's output; then `verdict_table` and the footer. Row and message text is never
rich markup (a detail such as `pip install -e '.[vllm]'` prints as it is).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from titan_audit.demo import Listener, Result, Row, ordered

COLORS = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}


class DemoView(Listener):
    """The demo on a rich console: a header rule, a transient progress bar while it runs, a line per
    stage and per verdict. Use it as a context manager around `run` (the bar goes when it exits)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task = None

    def __enter__(self) -> DemoView:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def print(self, text: str) -> None:
        (self.progress.console if self.progress else self.console).print(text)

    # ------------------------------------------------------------ Listener
    def on_start(self, out: Path, quick: bool, numerics: str, steps: int) -> None:
        self.console.rule(f"[bold]titan-audit demo{' --quick' if quick else ''}")
        self.console.print(escape(f"{numerics}; runs go to {out}"))
        columns = (
            SpinnerColumn(),
            TextColumn("[bold blue]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        self.progress = Progress(*columns, console=self.console, transient=True)
        self.progress.start()
        self.task = self.progress.add_task("starting", total=steps)

    def on_stage(self, name: str, title: str, background: bool = False) -> None:
        if not background:
            self.on_status(title)
        self.print(f"[bold]{escape(title)}[/]" + (" [dim](in the background)[/]" if background else ""))

    def on_status(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=escape(text))

    def on_done(self, name: str, seconds: float) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def on_row(self, row: Row) -> None:
        text = f"{escape(row.guarantee)}: {escape(row.checked)}" + (
            f" [dim]({escape(row.detail)})[/]" if row.detail else ""
        )
        self.print(f"  [{COLORS[row.result]}]{row.result}[/] {text}")

    def on_message(self, text: str) -> None:
        self.print(escape(text))

    def on_output(self, stage: str, line: str) -> None:
        self.print(f"[dim]{escape(stage)}> {escape(line)}[/]")

    # ------------------------------------------------------------ the end
    def finish(self, result: Result) -> None:
        """The verdict table, the footer rule, where the report is."""
        self.stop()
        self.console.print(verdict_table(result.rows, result.out))
        seconds = result.seconds
        self.console.rule(
            f"[green]demo passed: every guarantee held ({seconds:.0f} s)"
            if result.passed
            else f"[red]demo FAILED: see the FAIL rows ({seconds:.0f} s)"
        )
        report, out = result.report, result.out
        if report is not None:
            self.console.print(
                escape(f"report: {report['html']}  (markdown: {report['md']}; rebuild: titan-audit report {out})")
            )


def verdict_table(rows: list[Row], out: Path) -> Table:
    """The rows by guarantee (controls after their checks); evidence paths relative to OUT (runs) and
    to the working directory (the goldens, when under it: a checkout)."""
    table = Table(title=escape(f"titan-audit demo: verdicts (evidence under {out}/)"), title_justify="left")
    for column in ("guarantee", "what was checked", "result", "evidence"):
        table.add_column(column, overflow="fold")
    for r in ordered(rows):
        result = f"[{COLORS[r.result]}]{r.result}[/]" + (f" {escape(r.detail)}" if r.detail else "")
        evidence = r.evidence.replace(f"{out}/", "").replace(f"{Path.cwd()}/", "")
        table.add_row(escape(r.guarantee), escape(r.checked), result, escape(evidence))
    return table
