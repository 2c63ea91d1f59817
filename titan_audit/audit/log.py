"""The audit log: Parquet parts under RUN/audit/, written atomically, read lazily as one table.

Guarantees:
- Each flush writes one part, `RUN/audit/part-r<rank>-<n>.parquet`, first to a hidden temporary
  name in the same directory, fsynced, then renamed. A crash (SIGKILL included) at any moment
  leaves only complete parts under part names; a half-written temporary (`.part-*.tmp`) is never
  read. So the reader returns every record up to the last complete part.
- Parts are per rank and numbered on from the highest existing part of that rank, so several
  ranks can write into one run directory, and a resumed run appends without overwriting
  anything. No part is ever overwritten or deleted.
- The log can be read while the run is writing it: `read_audit_log` lists the part names present
  when it is called and concatenates them lazily through `pyarrow.dataset`.
- A part under a part name that is not a readable Parquet file with the audit schema (truncated
  or corrupted by something outside this writer) is reported as a ValueError naming the file, in
  one line: "RUN/audit/part-...parquet: unreadable (...); the audit log of this run is damaged: ...".
  Parts are written with Parquet page checksums (CRC32), verified whenever they are read, so a
  flipped byte in a data page is caught too (a part written before checksums is read unverified).
- `verify_audit_log` reads every existing part in full: the Recorder calls it (through
  `AuditLogWriter(..., verify=True)`) before it appends to an existing log (a resume), so nothing
  is appended to a damaged log.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from titan_audit.audit.schema import SCHEMA

AUDIT_DIR = "audit"
_PART_RE = re.compile(r"^part-r(\d{5})-(\d{8})\.parquet$")


def audit_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / AUDIT_DIR


def part_files(run_dir: str | os.PathLike) -> list[Path]:
    """The complete parts of a run's audit log, in (rank, part number) order."""
    directory = audit_dir(run_dir)
    if not directory.is_dir():
        return []
    parts = [p for p in directory.iterdir() if _PART_RE.match(p.name)]
    return sorted(parts, key=lambda p: p.name)


class AuditLogWriter:
    """Appends record batches to RUN/audit/ as atomic Parquet parts, one part per `write`. With
    `verify`, every part already there is read in full first (`verify_audit_log`): a damaged log
    raises ValueError naming the part before anything is appended."""

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, *, verify: bool = False) -> None:
        if rank < 0 or rank > 99999:
            raise ValueError(f"rank must be in [0, 99999], got {rank}")
        if verify and audit_dir(run_dir).is_dir():
            verify_audit_log(run_dir)
        self.directory = audit_dir(run_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        numbers = [
            int(m.group(2))
            for p in self.directory.iterdir()
            if (m := _PART_RE.match(p.name)) and int(m.group(1)) == rank
        ]
        self.next_part = max(numbers, default=-1) + 1

    def write(self, columns: dict[str, Sequence]) -> Path | None:
        """Write one part from column lists (SCHEMA's names); None when there are no rows."""
        table = pa.Table.from_pydict(dict(columns), schema=SCHEMA)
        if table.num_rows == 0:
            return None
        name = f"part-r{self.rank:05d}-{self.next_part:08d}.parquet"
        final = self.directory / name
        assert not final.exists(), f"{final} exists: parts are never overwritten"
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd", write_page_checksum=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        self.next_part += 1
        return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


DAMAGED_HINT = (
    "the audit log of this run is damaged: restore the part from a copy, or move it out of "
    f"{AUDIT_DIR}/ (its records are then missing from the log)"
)


def _damaged(part: Path, what: str, error: BaseException | str) -> ValueError:
    detail = " ".join(str(error).split())  # one line: pyarrow's messages may span several
    if len(detail) > 200:
        detail = detail[:200] + "..."
    return ValueError(f"{part}: unreadable ({what}{detail}); {DAMAGED_HINT}")


def _check_columns(part: Path, names: list[str]) -> None:
    missing = [name for name in SCHEMA.names if name not in names]
    if missing:
        raise _damaged(part, "", f"not an audit-log part: missing columns {', '.join(missing)}")


def check_parts(parts: list[Path]) -> None:
    """ValueError naming the first part that is not a readable audit-log Parquet file (its footer
    and schema: cheap; `verify_audit_log` reads the data too)."""
    for part in parts:
        try:
            schema = pq.read_schema(part)
        except (pa.ArrowInvalid, OSError) as error:
            raise _damaged(part, "not a readable Parquet file: ", error) from None
        _check_columns(part, schema.names)


def verify_part(part: Path) -> int:
    """Read one part in full (page checksums verified); its number of records, or ValueError."""
    try:
        table = pq.read_table(part, page_checksum_verification=True)
        table.validate(full=True)
    except (pa.ArrowInvalid, OSError) as error:
        what = "not a readable Parquet file: " if "magic bytes" in str(error) else ""
        raise _damaged(part, what, error) from None
    _check_columns(part, table.column_names)
    return table.num_rows


def verify_audit_log(run_dir: str | os.PathLike) -> int:
    """Read every complete part of the run's audit log in full: the number of records, or a
    ValueError naming the first damaged part (see the module docstring)."""
    return sum(verify_part(part) for part in part_files(run_dir))


_SCAN = ds.ParquetFragmentScanOptions(page_checksum_verification=True)


def audit_dataset(run_dir: str | os.PathLike, *, check: bool = True) -> ds.Dataset:
    """The run's audit log as one lazy pyarrow dataset over its complete parts."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not audit_dir(run_dir).is_dir():
        raise ValueError(f"{run_dir}: not a run with an audit log ({AUDIT_DIR}/ not found)")
    parts = part_files(run_dir)
    if check:
        check_parts(parts)
    return ds.dataset(
        [str(p) for p in parts], schema=SCHEMA, format=ds.ParquetFileFormat(default_fragment_scan_options=_SCAN)
    )


def read_audit_log(
    run_dir: str | os.PathLike,
    *,
    columns: list[str] | None = None,
    filter: ds.Expression | None = None,
) -> pa.Table:
    """Every record of the run's complete parts as one table (SCHEMA), optionally filtered. A part
    whose data cannot be read raises a ValueError naming that part."""
    dataset = audit_dataset(run_dir)
    try:
        return dataset.to_table(columns=columns, filter=filter)
    except (pa.ArrowInvalid, OSError) as error:
        for part in part_files(run_dir):  # which part: read each in full (the error path only)
            verify_part(part)
        raise ValueError(
            f"{audit_dir(run_dir)}: the audit log cannot be read ({' '.join(str(error).split())})"
        ) from None
