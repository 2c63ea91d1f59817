"""The divergence map of two runs: which steps and which modules / phases differ.

    grid = divergence_map("runs/a", "runs/b")   # rows (phase, module group) x steps

Guarantees:
- The join is `compare`'s: records keyed by (step, phase, microbatch, name), hashes compared
  (nothing loosened), `rank` ignored so runs at different world sizes compare. A key counts as
  differing when both runs hold it and the hash sets differ, or when a run recorded it more than
  once with different hashes; a key one run lacks counts as `only_a` / `only_b`. So the map's
  totals agree with `audit.compare_runs` (differing + one-side-only events).
- Rows group record names by module: the name's first component, or its first two when the second
  is a layer index (`layers.3.mlp.down_proj.weight` -> `layers.3`; `embed_tokens.weight` ->
  `embed_tokens`), within each phase, in the phases' execution order, then in natural order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from titan_audit.audit.compare import joined_records
from titan_audit.audit.schema import PHASE_RANK


def module_group(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 2 and parts[1].split("@")[0].split("#")[0].isdigit():
        return f"{parts[0]}.{parts[1].split('@')[0].split('#')[0]}"
    return parts[0].split("@")[0].split("#")[0].split("[")[0]


def _natural(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


@dataclass
class Cell:
    compared: int = 0  # keys in both runs
    differing: int = 0  # of those, hash differs (or a conflicting repeat)
    only_a: int = 0
    only_b: int = 0

    @property
    def total(self) -> int:
        return self.compared + self.only_a + self.only_b

    @property
    def events(self) -> int:
        return self.differing + self.only_a + self.only_b


@dataclass
class DivergenceMap:
    run_a: str
    run_b: str
    steps: list[int]
    rows: list[tuple[str, str]]  # (phase, module group)
    cells: dict[tuple[int, int], Cell]  # (row index, step) -> cell

    @property
    def identical(self) -> bool:
        return not any(c.events for c in self.cells.values())

    def totals(self) -> Cell:
        out = Cell()
        for c in self.cells.values():
            out.compared += c.compared
            out.differing += c.differing
            out.only_a += c.only_a
            out.only_b += c.only_b
        return out

    def first_step(self) -> int | None:
        steps = [s for (_, s), c in self.cells.items() if c.events]
        return min(steps) if steps else None

    def row_summary(self) -> list[dict]:
        """Per row: records compared, differing, one-side-only, first step with a difference."""
        out = []
        for i, (phase, group) in enumerate(self.rows):
            cells = [(s, self.cells[(i, s)]) for s in self.steps if (i, s) in self.cells]
            first = next((s for s, c in cells if c.events), None)
            out.append(
                {
                    "phase": phase,
                    "module": group,
                    "compared": sum(c.compared for _, c in cells),
                    "differing": sum(c.differing for _, c in cells),
                    "one_side_only": sum(c.only_a + c.only_b for _, c in cells),
                    "first_step": first,
                }
            )
        return out


def divergence_map(run_a: str | os.PathLike, run_b: str | os.PathLike) -> DivergenceMap:
    joined = joined_records(run_a, run_b)
    rows: dict[tuple[str, str], int] = {}
    raw: dict[tuple[tuple[str, str], int], Cell] = {}
    names = (
        "step",
        "phase",
        "name",
        "_compared",
        "_differing",
        "_only_in_a",
        "_only_in_b",
        "_conflict_in_a",
        "_conflict_in_b",
    )
    for step, phase, name, both, differ, only_a, only_b, conflict_a, conflict_b in zip(
        *(joined[c].to_pylist() for c in names)
    ):
        row = (phase, module_group(name))
        cell = raw.setdefault((row, step), Cell())
        rows.setdefault(row, 0)
        cell.only_a += only_a
        cell.only_b += only_b
        cell.compared += both
        cell.differing += both and (differ or conflict_a or conflict_b)
    order = sorted(rows, key=lambda r: (PHASE_RANK.get(r[0], len(PHASE_RANK)), r[0], _natural(r[1])))
    index = {row: i for i, row in enumerate(order)}
    cells = {(index[row], step): cell for (row, step), cell in raw.items()}
    steps = sorted({step for (_, step) in raw})
    return DivergenceMap(str(run_a), str(run_b), steps, order, cells)
