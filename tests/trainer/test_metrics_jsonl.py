"""metrics.jsonl at a resume (trainer/metrics_out.py): cut back in place, from the end, when it ends
with the last kept row's line; rewritten from the kept rows otherwise.

Proves: a file that ends with the kept rows' last line, then the lines of the steps a resume runs
again and a line a kill cut short, is truncated right after that line (the same inode; the kept rows
are not iterated), also when that line lies many read blocks back; controls, each rewritten from the rows:
a step missing before the end, a last kept line that another start wrote (another `seconds`), a
line that is not JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_audit.trainer.metrics_out import JSONL, MetricsStreams


@dataclass
class Logging:
    jsonl: bool = True
    tensorboard: bool = False


def _row(step: int, seconds: float = 0.5) -> dict:
    return {"step": step, "loss": 1.0 / step, "seconds": seconds * step, "note": None}


class Rows(list):
    """The kept rows, counting how many times they are iterated in full."""

    iterated = 0

    def __iter__(self):
        Rows.iterated += 1
        return super().__iter__()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


@pytest.fixture
def run(tmp_path) -> Path:
    _write(tmp_path / JSONL, [_row(s) for s in range(1, 11)], '{"step": 11, "lo')
    return tmp_path


def test_a_resume_cuts_the_file_back_in_place(run):
    inode = (run / JSONL).stat().st_ino
    Rows.iterated = 0
    streams = MetricsStreams(run, Logging(), Rows(_row(s) for s in range(1, 7)))
    streams.write(_row(7))
    streams.close()
    assert Rows.iterated == 0 and (run / JSONL).stat().st_ino == inode
    assert _lines(run / JSONL) == [_row(s) for s in range(1, 8)]


@pytest.mark.parametrize(
    "damage",
    ["a step missing", "another start's line", "not JSON"],
)
def test_otherwise_it_is_rewritten_from_the_rows(run, damage):
    rows = [_row(s) for s in range(1, 11)]
    if damage == "a step missing":
        _write(run / JSONL, rows[:5] + rows[6:])  # ends with 10, step 6 absent
    elif damage == "another start's line":
        _write(run / JSONL, rows[:5] + [_row(6, seconds=0.75)] + rows[6:])
    else:
        _write(run / JSONL, rows[:6] + [{"step": 7}], "not json\n")
    inode = (run / JSONL).stat().st_ino
    Rows.iterated = 0
    MetricsStreams(run, Logging(), Rows(_row(s) for s in range(1, 7))).close()
    assert Rows.iterated == 1 and (run / JSONL).stat().st_ino != inode
    assert _lines(run / JSONL) == rows[:6]


def test_the_line_is_found_across_blocks(run, monkeypatch):
    from titan_audit.trainer import metrics_out

    real = metrics_out._cut_back
    monkeypatch.setattr(metrics_out, "_cut_back", lambda path, last: real(path, last, block=16))
    Rows.iterated = 0
    MetricsStreams(run, Logging(), Rows(_row(s) for s in range(1, 3))).close()
    assert _lines(run / JSONL) == [_row(1), _row(2)] and Rows.iterated == 0
