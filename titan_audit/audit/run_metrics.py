"""RUN/metrics.parquet, one row per step: the one reader (`read_metrics`) and writer (`MetricsLog`)
every layer uses (golden store and check, reports, bench, scripts).

Layout: RUN/metrics.parquet is a directory of Parquet chunks `part-<k>.parquet`, chunk k holding
rows k*CHUNK .. (k+1)*CHUNK - 1 in step order: a Parquet dataset directory, which pyarrow and
pandas (`read_parquet`) also read as one table, hidden temporaries ignored.

Guarantees:
- Appended, never rewritten whole: a flush rewrites only the chunks whose rows changed since the
  last flush, each atomically (temp file, fsync, rename: titan_audit.atomic). During a run that
  is the last chunk, at most CHUNK rows, so N steps write O(N * CHUNK) bytes, not O(N^2).
- A resume drops the rows after its checkpoint (they are run again, `truncate_after`): at the
  next flush the chunk holding the first dropped row is rewritten without them and the chunks
  after it are removed. Nothing else is ever removed.
- The writer keeps the last chunk's rows in memory, not the run's: opening a run reads its last
  chunk (and a resume's truncation the chunks it cuts), whatever the run's length. `rows` reads
  the earlier chunks only when iterated.
- A run written before the chunks (metrics.parquet a single file) and a golden (a file) read as
  they are. A writer opening such a run moves its rows into chunks once: built under a hidden
  name, the file renamed to `.metrics.parquet.v1`, the chunks renamed into place, then the file
  removed. A crash between the renames leaves `.metrics.parquet.v1`, which `read_metrics` reads
  and the next writer moves on from.
- `read_metrics(run)` returns every row as one table (chunks in order, types unified: a column
  all null in one chunk takes the type of another), None when the run has no metrics; a file
  that is not readable Parquet, or a table without a `step` column, is a ValueError naming it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from titan_audit.atomic import write_bytes_atomic
from titan_audit.audit.log import fsync_dir

METRICS = "metrics.parquet"
CHUNK = 256  # rows per chunk file
_CHUNK_RE = re.compile(r"^part-(\d{8})\.parquet$")
_LEGACY_ASIDE = ".metrics.parquet.v1"  # a single-file metrics.parquet while it becomes chunks
_BUILDING = ".metrics.parquet.chunks"  # the chunks of a single-file run while they are written


def metrics_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / METRICS


def chunk_files(run_dir: str | os.PathLike) -> list[Path]:
    """The chunk files of a run's metrics directory, in order ([] for a single-file run)."""
    path = metrics_path(run_dir)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if _CHUNK_RE.match(p.name))


def _read_file(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({' '.join(str(error).split())})") from None


def read_metrics(run_dir: str | os.PathLike, columns: list[str] | None = None) -> pa.Table | None:
    """The run's metrics rows as one table (see the module docstring); None when it has none."""
    path = metrics_path(run_dir)
    if path.is_dir():
        files = chunk_files(run_dir)
    elif path.is_file():
        files = [path]
    elif (aside := Path(run_dir) / _LEGACY_ASIDE).is_file():
        files = [aside]
    else:
        return None
    if not files:
        return None
    tables = [_read_file(f) for f in files]
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise ValueError(f"{path}: chunks with conflicting columns ({' '.join(str(error).split())})") from None
    if "step" not in table.column_names:
        raise ValueError(f"{files[0]}: no 'step' column")
    if columns is not None:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(map(repr, missing))}")
        table = table.select(columns)
    return table


def _parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def _chunk_name(k: int) -> str:
    return f"part-{k:08d}.parquet"


class MetricsLog:
    """The metrics of one run, rank 0's writer (see the module docstring). It holds in memory the
    rows of the last chunk and those appended since the last flush, whatever the run's length.
    `rows`: every row, in step order, as a sequence that reads earlier chunks when iterated;
    `append` adds one, `flush` writes the chunks that changed."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = metrics_path(run_dir)
        self._from_single_file()
        files = chunk_files(run_dir)
        self._chunks = len(files)  # chunk files on disk
        last = pq.ParquetFile(files[-1]).metadata.num_rows if files else 0
        if [f.name for f in files] == [_chunk_name(k) for k in range(len(files))] and last <= CHUNK:
            self._base = max(len(files) - 1, 0)  # leading chunks left on disk, CHUNK rows each
            self._tail: list[dict[str, Any]] = _read_file(files[-1]).to_pylist() if files else []
            self._clean = self._base * CHUNK + len(self._tail)  # rows[:clean] are on disk as they are
            self._dirty = False
        else:  # chunks this writer did not lay out: every row in memory, every chunk rewritten
            table = read_metrics(run_dir)
            self._base, self._tail, self._clean, self._dirty = 0, [] if table is None else table.to_pylist(), 0, True

    @property
    def rows(self) -> Sequence[dict[str, Any]]:
        return _Rows(self)

    def _chunk_rows(self, k: int) -> list[dict[str, Any]]:
        return _read_file(self.path / _chunk_name(k)).to_pylist()

    def _from_single_file(self) -> None:
        """Move the rows of a single-file metrics.parquet into chunks (once; see the docstring)."""
        aside = self.run_dir / _LEGACY_ASIDE
        if self.path.is_file():
            source = self.path
        elif not self.path.exists() and aside.is_file():
            source = aside  # a crash between the two renames: go on from the file moved aside
        else:
            return
        rows = _read_file(source).to_pylist()
        building = self.run_dir / _BUILDING
        shutil.rmtree(building, ignore_errors=True)  # what a killed writer left of its build
        building.mkdir()
        for k in range(0, len(rows), CHUNK):
            write_bytes_atomic(building / _chunk_name(k // CHUNK), _parquet_bytes(rows[k : k + CHUNK]))
        if source == self.path:
            os.replace(self.path, aside)
        os.rename(building, self.path)
        fsync_dir(self.run_dir)
        aside.unlink()

    def truncate_after(self, step: int) -> None:
        """Forget rows after `step` (a resume runs them again); the next flush writes it. Reads
        back only the chunks that hold such rows."""
        while self._base and (not self._tail or self._tail[0]["step"] > step):
            self._base -= 1
            self._tail = self._chunk_rows(self._base) + self._tail
        first = next((i for i, row in enumerate(self._tail) if row["step"] > step), len(self._tail))
        if first < len(self._tail):
            self._tail = self._tail[:first] + [row for row in self._tail[first:] if row["step"] <= step]
            self._clean = min(self._clean, self._base * CHUNK + first)
            self._dirty = True

    def append(self, row: dict[str, Any]) -> None:
        self._tail.append(row)
        self._dirty = True

    def flush(self) -> None:
        """Rewrite the chunks holding rows changed since the last flush; remove chunks past the end."""
        if not self._dirty:
            return
        n = self._base * CHUNK + len(self._tail)
        needed = -(-n // CHUNK)
        self.path.mkdir(exist_ok=True)
        for k in range(self._clean // CHUNK, needed):
            rows = self._tail[(k - self._base) * CHUNK : (k - self._base + 1) * CHUNK]
            write_bytes_atomic(self.path / _chunk_name(k), _parquet_bytes(rows), overwrite=True)
        for k in range(needed, self._chunks):  # rows a resume dropped
            (self.path / _chunk_name(k)).unlink(missing_ok=True)
        self._chunks, self._clean, self._dirty = needed, n, False
        keep = max(needed - 1, self._base)  # the last chunk stays in memory
        self._tail = self._tail[(keep - self._base) * CHUNK :]
        self._base = keep


class _Rows(Sequence):
    """A MetricsLog's rows, read from its chunks when asked for (the last chunk is in memory)."""

    def __init__(self, log: MetricsLog) -> None:
        self._log = log

    def __len__(self) -> int:
        return self._log._base * CHUNK + len(self._log._tail)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        at = i - self._log._base * CHUNK
        return self._log._tail[at] if at >= 0 else self._log._chunk_rows(i // CHUNK)[i % CHUNK]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for k in range(self._log._base):
            yield from self._log._chunk_rows(k)
        yield from self._log._tail
