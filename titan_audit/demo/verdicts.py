"""The demo's verdicts: a `Row` per check or control, their table order, and the `Result` `run` returns.

Guarantees: a row's result is PASS, FAIL or SKIP; `ordered` puts the rows by guarantee with each
control after its checks (the order of demo.json and of the verdict table); `Result.passed` is
what the CLI's exit code reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    guarantee: str
    checked: str
    result: str  # PASS | FAIL | SKIP
    detail: str = ""
    evidence: str = ""


def _order(row: Row) -> tuple[str, bool]:
    return (row.guarantee.split()[0] if row.guarantee.startswith("G") else "Z", row.guarantee.endswith("control"))


def ordered(rows: list[Row]) -> list[Row]:
    """The rows by guarantee, controls after their checks (the order of demo.json and the verdict table)."""
    return sorted(rows, key=_order)


@dataclass
class Result:
    """What `run` returns: the verdicts in table order (controls after their checks), the stages'
    timings, the report's paths (None if writing it failed: then a FAIL row says why)."""

    out: Path
    quick: bool
    passed: bool
    rows: list[Row]
    seconds: float
    numerics: str
    stages: list[dict[str, Any]]
    report: dict[str, str] | None

    def __bool__(self) -> bool:  # `if not run(...)` is `if not run(...).passed`
        return self.passed
