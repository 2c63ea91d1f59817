"""What the demo reports as it runs: a `Listener` of plain callbacks, which by default logs.

Guarantees: the demo draws nothing itself; every stage, verdict, message and subprocess line
goes to a `Listener` (the terminal view, titan_audit.cli.demo_view, is one). Calls come from the
main thread and from the thread of the background 2-rank run.
"""

from __future__ import annotations

from pathlib import Path

from titan_audit.demo.verdicts import Row
from titan_audit.log import get_logger

log = get_logger("titan_audit.demo")


class Listener:
    """What the demo reports as it runs; subclass it and override what you show. This default logs
    through `titan_audit.log`. Calls come from the main thread and from the thread of the 2-rank
    run that runs in the background (its stage, rows, messages and output lines)."""

    def on_start(self, out: Path, quick: bool, numerics: str, steps: int) -> None:
        """The demo starts writing into `out`; `steps` calls of `on_done` will follow (the stages, then the report)."""
        log.info("titan-audit demo%s: %s; runs go to %s", " --quick" if quick else "", numerics, out)

    def on_stage(self, name: str, title: str, background: bool = False) -> None:
        """Stage `name` starts (`title`: what it does; `background`: it runs alongside the next ones)."""
        log.info("%s%s", title, " (in the background)" if background else "")

    def on_status(self, text: str) -> None:
        """What the demo is doing between stages: "waiting for the 2-rank run", "writing the report"."""
        log.debug("%s", text)

    def on_done(self, name: str, seconds: float) -> None:
        """One of the `steps` is done: a stage (failed or not; a failure is a FAIL row), or "report"."""
        log.debug("%s done in %.1f s", name, seconds)

    def on_row(self, row: Row) -> None:
        """A verdict."""
        log.info("  %s %s: %s%s", row.result, row.guarantee, row.checked, f" ({row.detail})" if row.detail else "")

    def on_message(self, text: str) -> None:
        """A line about what a stage did (or, with `verbose`, the traceback of a stage that failed)."""
        log.info("%s", text)

    def on_output(self, stage: str, line: str) -> None:
        """A line (no newline) of a subprocess stage's output; only with `verbose` (it is in OUT/logs/ always)."""
        log.debug("%s> %s", stage, line)
