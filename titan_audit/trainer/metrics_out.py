"""The metrics streams beside RUN/metrics.parquet: RUN/metrics.jsonl and TensorBoard event files.

    streams = MetricsStreams(run_dir, config.logging, history=metrics_log.rows)   # rank 0, at begin
    streams.write(row)                                                            # every step
    streams.close()

Guarantees (the engine opens them on rank 0 only, for `train` and `rl` alike):
- `logging.jsonl` (default on): RUN/metrics.jsonl holds one JSON object per step, the same keys
  and values as that step's metrics.parquet row (`json.loads(line) == row`; floats round-trip
  exactly, a non-finite one is written as Python's json writes it: NaN, Infinity). Appended and
  flushed every step, so `tail -f` follows a run.
- `logging.tensorboard`: RUN/tensorboard/ holds TensorBoard event files (torch's SummaryWriter),
  one scalar per numeric metric (its key as the tag, `step` as the global step; TensorBoard stores
  float32), flushed every step. Without the `tensorboard` package the run is refused before any
  work (`check_logging`, ValueError with the install hint).
- A resume neither loses nor repeats a step, as metrics.parquet: its rows after the resumed
  checkpoint are dropped (they are run again) and the streams start from the rows kept.
  metrics.jsonl is cut back to the line of the last kept row, dropping the lines after it and a
  line a kill cut short (read from the end, so the cost does not grow with the run; a truncation
  in place, which a kill leaves done or not done), when that line equals the row; otherwise (a
  stream turned on only at this resume, lines missing or written by another start while it was
  off) it is rewritten from the kept rows once (atomically: temp file + rename). TensorBoard,
  whose files are append-only, gets a new event file that starts with a purge marker at step 1
  (SummaryWriter's `purge_step`: TensorBoard's readers drop every event of the earlier files from
  that step on) and then the kept rows again (so with TensorBoard on, a start reads every row).
  So the streams hold each step once, whatever happened before: a kill at any point, or a stream
  turned on only at this resume.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_audit.atomic import write_bytes_atomic

JSONL = "metrics.jsonl"
TENSORBOARD = "tensorboard"
INSTALL_HINT = "pip install tensorboard (or the package's `test` extra)"


def check_logging(config: Any) -> None:
    """ValueError when `logging.tensorboard` is on and the tensorboard package is missing."""
    if config.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"logging.tensorboard = true needs the tensorboard package: {INSTALL_HINT}")


def _json_line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


def _cut_back(path: Path, last: dict[str, Any], block: int = 1 << 16) -> bool:
    """Truncate metrics.jsonl right after its line of the row `last`, when that line equals it
    (so the start that wrote the line wrote that metrics.parquet row, and the lines before it) and
    the lines after it are all of later steps (or a last line a kill cut short); False, nothing
    changed, when the file does not end that way. Reads blocks from the end, back to that line."""
    step = last["step"]
    size = path.stat().st_size
    with path.open("rb") as f:
        start = size
        while True:
            start = max(0, start - block)
            f.seek(start)
            data = f.read(size - start)
            lines = data.split(b"\n")
            end = size - len(lines.pop())  # the text after the last newline: a line cut short, or b""
            complete = lines if start == 0 else lines[1:]  # the first may begin before `start`
            for line in reversed(complete):
                try:
                    row = json.loads(line)
                except ValueError:
                    return False
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    return False
                if row["step"] == step:
                    if row != last:
                        return False  # written by another start than the row: rewrite
                    os.truncate(path, end)
                    return True
                if row["step"] < step:
                    return False  # a step missing: rewrite
                end -= len(line) + 1
            if start == 0:
                return False
            block *= 2


class MetricsStreams:
    """metrics.jsonl and TensorBoard for one start of a run (see the module docstring). `history`:
    the metrics.parquet rows this start keeps (up to the resumed step), in step order (a sequence
    read only as far as needed: audit.run_metrics.MetricsLog.rows)."""

    def __init__(self, run_dir: str | os.PathLike, logging: Any, history: Sequence[dict[str, Any]]) -> None:
        run_dir = Path(run_dir)
        self._jsonl = None
        self._writer = None
        if logging.jsonl:
            path = run_dir / JSONL
            if not (len(history) and path.is_file() and _cut_back(path, history[-1])):
                text = "".join(_json_line(row) for row in history)
                write_bytes_atomic(path, text.encode(), overwrite=True)
            self._jsonl = path.open("a", encoding="utf-8")
        if logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = run_dir / TENSORBOARD
            earlier = log_dir.is_dir() and any(log_dir.iterdir())
            self._writer = SummaryWriter(str(log_dir), purge_step=1 if earlier else None)
            for row in history:
                self._scalars(row)
            self._writer.flush()

    def _scalars(self, row: dict[str, Any]) -> None:
        step = row["step"]
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def write(self, row: dict[str, Any]) -> None:
        """One step's metrics row (the one metrics.parquet got), flushed."""
        if self._jsonl is not None:
            self._jsonl.write(_json_line(row))
            self._jsonl.flush()
        if self._writer is not None:
            self._scalars(row)
            self._writer.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
