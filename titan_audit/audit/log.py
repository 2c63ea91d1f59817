"""The audit log: Parquet parts under RUN/audit/, written atomically, read lazily as one table.

Guarantees:
- Each flush writes one part, `RUN/audit/part-r<rank>-<n>.parquet`, first to a hidden temporary
  name in the same directory, fsynced, then renamed. `AuditLogWriter.submit` writes a part on
  one background thread (parts in order, one at a time; `wait` returns when it is committed and
  raises what the write raised), so a training step need not wait for its encoding and fsyncs.
  A crash (SIGKILL included) at any moment leaves only complete parts under part names; a
  half-written temporary (`.part-*.tmp`) is never read. So the reader returns every record up to
  the last complete part.
- Parts are per rank and numbered on from that rank's last part (its index, and any part
  committed after the index was last written), so several ranks can write into one run
  directory, and a resumed run appends without overwriting anything. No part is ever
  overwritten or deleted.
- The log can be read while the run is writing it: `read_audit_log` lists the part names present
  when it is called and concatenates them lazily through `pyarrow.dataset`.
- A part under a part name that is not a readable Parquet file with the audit schema (truncated
  or corrupted by something outside this writer) is reported as a ValueError naming the file, in
  one line: "RUN/audit/part-...parquet: unreadable (...); the audit log of this run is damaged: ...".
  Parts are written with Parquet page checksums (CRC32), verified whenever they are read, so a
  flipped byte in a data page is caught too (a part written before checksums is read unverified).
- Each committed part gets an entry in the index RUN/audit/_index/ (audit.log_index): its size,
  records, steps and the xxh3-128 digest of its bytes, in files of bounded size written
  atomically. What checks the log, and what it costs:
  - `check_audit_log(run, after_step=S)`, a resume's check (before any rank starts): per rank,
    the parts committed after the index, the newest part (what the resume appends to), and every
    part whose records go past step S (the checkpoint it resumes from, back to the newest part
    that does not) are read in full and against their digests. With `mark` a part read back is
    marked `checked` in the index and not read again; the trainer's pre-checks (the launcher's
    and rank 0's) pass mark=False, so a resume refused later (a damaged checkpoint) leaves the
    run's files as they were. The parts and index bytes read do not grow with the run's length;
    older parts stand on their digests.
  - `AuditLogWriter(..., verify=True)` (the Recorder's, once the checkpoint has loaded): the same
    for its own rank, without S, marking what it read.
  - `verify_log` / `verify_audit_log` (`titan-audit verify RUN`): every part in full against its
    digest, every index entry against an existing part.
  A run without an index (written before it existed) has every part read in full once, at its
  first check or writer, and its index built then.
- A resume reads its tail once: a check returns what it read and matched (`LogCheck.verified`:
  part name -> [bytes, xxh3, mtime_ns]); handed to a later check (`known=`) or marked into a
  rank's index before its writer opens (`mark_known`), a part whose index entry and file are
  unchanged since is not read again; one that changed in between (its size, digest or
  modification time) is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import xxhash

from titan_audit.audit.log_index import INDEX_DIR, PartEntry, RankIndex, ensure_index, index_dir, index_ranks, part_name
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
    """Appends record batches to RUN/audit/ as atomic Parquet parts, one part per `write`, each
    committed to the index (audit.log_index) with its digest. Opening reads this rank's index
    head, reads in full and indexes the parts committed after it (a crash between a part's rename
    and its index write), and with `verify` also the rank's last part, unless a check since it was
    committed already read it back (`checked`): a damaged part raises ValueError naming it before
    anything is appended. A run without an index (written before it existed) has every part
    verified and the index built once (`open_index`). `check` tells what opening read."""

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, *, verify: bool = False) -> None:
        if rank < 0 or rank > 99999:
            raise ValueError(f"rank must be in [0, 99999], got {rank}")
        self.directory = audit_dir(run_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.check = LogCheck()
        open_index(run_dir, self.check, ranks=(rank,))
        index = RankIndex.load(self.directory, rank)
        if index is None:  # a rank new to this run: its head exists before its first part
            index = RankIndex(self.directory, rank)
            index.save()
        _check_rank(index, self.check, after_step=None, last=verify)
        self.index = index
        self.next_part = index.next_part()
        self._pool: ThreadPoolExecutor | None = None
        self._writing: Future | None = None

    def submit(self, rows: list[tuple]) -> None:
        """Write the part of `rows` (tuples in SCHEMA's column order) on the background thread,
        after the part before it (`wait`s for that one first, raising what it raised)."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-audit-log")
        self._writing = self._pool.submit(self.write_rows, rows)

    def wait(self) -> Path | None:
        """The path of the part `submit` is writing, once committed (None if none is in flight)."""
        writing, self._writing = self._writing, None
        return None if writing is None else writing.result()

    def close(self) -> None:
        """`wait`, then stop the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def write_rows(self, rows: list[tuple]) -> Path | None:
        """`write` of rows given as tuples in SCHEMA's column order."""
        return self.write(dict(zip(SCHEMA.names, map(list, zip(*rows)))))

    def write(self, columns: dict[str, Sequence]) -> Path | None:
        """Write one part from column lists (SCHEMA's names); None when there are no rows."""
        table = pa.Table.from_pydict(dict(columns), schema=SCHEMA)
        if table.num_rows == 0:
            return None
        data, entry = encode_part(table, self.next_part)
        name = part_name(self.rank, self.next_part)
        final = self.directory / name
        if final.exists():
            raise ValueError(
                f"{final}: exists but is not in the audit log's index ({self.index.path}); "
                f"`titan-audit verify {self.directory.parent}` checks the whole log"
            )
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.directory)
        self.index.add(entry)
        self.index.save()
        self.next_part += 1
        return final


def encode_part(table: pa.Table, part: int) -> tuple[bytes, PartEntry]:
    """The bytes of one part holding `table` (SCHEMA, at least one row: zstd, page checksums) and
    its index entry (not checked)."""
    assert table.num_rows > 0 and table.schema.equals(SCHEMA), "a part holds records of SCHEMA"
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    data = sink.getvalue().to_pybytes()
    steps = pc.min_max(table["step"])
    return data, PartEntry(part, len(data), table.num_rows, steps["min"].as_py(), steps["max"].as_py(), _digest(data))


def fsync_dir(directory: Path) -> None:
    """fsync a directory (a rename in it is durable after); where the OS refuses, nothing."""
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


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


DAMAGED_HINT = (
    "the audit log of this run is damaged: restore the part from a copy, or move it out of "
    f"{AUDIT_DIR}/ (its records are then missing from the log) together with {AUDIT_DIR}/{INDEX_DIR}/ "
    "(the next resume reads every part and indexes them again)"
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


@dataclass
class PartReading:
    """What reading one part in full found: its size, records, steps and digest."""

    bytes: int
    rows: int
    first_step: int
    last_step: int
    xxh3: str


def verify_part(part: Path, entry: PartEntry | None = None) -> PartReading:
    """Read one part in full (page checksums verified, the audit schema, and with `entry` its
    size and digest against the index); what it holds, or ValueError naming the part."""
    try:
        data = part.read_bytes()
    except FileNotFoundError:
        raise _damaged(part, "", "missing" + (", though listed in the index" if entry else "")) from None
    try:
        table = pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
        table.validate(full=True)
    except (pa.ArrowInvalid, OSError) as error:
        what = "not a readable Parquet file: " if "magic bytes" in str(error) else ""
        raise _damaged(part, what, error) from None
    _check_columns(part, table.column_names)
    digest = _digest(data)
    if entry is not None and (len(data), digest) != (entry.bytes, entry.xxh3):
        raise _damaged(
            part, "", f"{len(data)} bytes with xxh3 {digest}, the index holds {entry.bytes} bytes with {entry.xxh3}"
        )
    steps = pc.min_max(table["step"]) if table.num_rows else None
    first, last = (steps["min"].as_py(), steps["max"].as_py()) if steps is not None else (0, -1)
    return PartReading(len(data), table.num_rows, first, last, digest)


@dataclass
class LogCheck:
    """What a check of the audit log read (the cost a resume pays for it)."""

    parts_verified: int = 0  # parts read in full: page checksums, schema, digest
    bytes_read: int = 0  # their bytes
    index_bytes_read: int = 0  # bytes of index files read
    parts_indexed: int = 0  # parts found after the index (or without one) and added to it
    legacy: bool = False  # the run had no index: every part was verified and the index built
    verified: dict[str, list[int | str]] = field(default_factory=dict)  # name -> [bytes, xxh3, mtime_ns]

    def read(self, part: Path, entry: PartEntry | None = None) -> PartReading:
        mtime = _mtime(part)
        reading = verify_part(part, entry)
        self.parts_verified += 1
        self.bytes_read += reading.bytes
        if mtime is not None:
            self.verified[part.name] = [reading.bytes, reading.xxh3, mtime]
        return reading


def _mtime(part: Path) -> int | None:
    try:
        return part.stat().st_mtime_ns
    except FileNotFoundError:
        return None  # verify_part says so, naming the part


def _unchanged(part: Path, entry: PartEntry, known: dict[str, list[int | str]] | None) -> bool:
    """Whether `known` (a check's `verified`) holds `part` as its index `entry` and its file are now."""
    stamp = (known or {}).get(part.name)
    if stamp is None or [entry.bytes, entry.xxh3] != list(stamp[:2]):
        return False
    try:
        stat = part.stat()
    except FileNotFoundError:
        return False
    return [stat.st_size, stat.st_mtime_ns] == [stamp[0], stamp[2]]


def _entry(part: int, reading: PartReading) -> PartEntry:
    return PartEntry(part, reading.bytes, reading.rows, reading.first_step, reading.last_step, reading.xxh3, True)


def open_index(run_dir: str | os.PathLike, check: LogCheck, ranks: Sequence[int] = ()) -> None:
    """Make sure RUN/audit/_index/ exists: a run without one (written before it existed) has every
    part read in full (`check` counts them) and the index of every rank built from what was read;
    `ranks` get an (empty) head if they have no part yet."""
    directory = audit_dir(run_dir)
    if index_dir(directory).is_dir():
        return
    build: dict[int, list[PartEntry]] = {rank: [] for rank in ranks}
    for part in part_files(run_dir):  # a listing: only where there is no index yet
        match = _PART_RE.match(part.name)
        assert match is not None
        build.setdefault(int(match.group(1)), []).append(_entry(int(match.group(2)), check.read(part)))
    check.legacy = check.parts_verified > 0
    check.parts_indexed += check.parts_verified
    ensure_index(directory, build)


def _check_rank(
    index: RankIndex,
    check: LogCheck,
    *,
    after_step: int | None,
    last: bool,
    save: bool = True,
    known: dict[str, list[int | str]] | None = None,
) -> None:
    """Read back in full the parts of one rank after its index (and index them), and with `last`
    the newest indexed part; with `after_step` also every newer part whose records go past that
    step and the newest one that does not. Entries already `checked`, or unchanged since `known`
    verified them, are not read again."""
    targets: list[PartEntry] = []
    if last or after_step is not None:
        for entry in index.newest_first():
            targets.append(entry)
            if after_step is None or entry.last_step <= after_step:
                break
    for entry in targets:
        if entry.checked:
            continue
        part = index.audit_dir / part_name(index.rank, entry.part)
        if not _unchanged(part, entry, known):
            check.read(part, entry)
        index.mark_checked(entry)
    for n in index.unindexed_parts():
        index.add(_entry(n, check.read(index.audit_dir / part_name(index.rank, n))))
        check.parts_indexed += 1
    if save:
        index.save()
    check.index_bytes_read += index.bytes_read


def check_audit_log(
    run_dir: str | os.PathLike,
    *,
    after_step: int | None = None,
    mark: bool = True,
    known: dict[str, list[int | str]] | None = None,
) -> LogCheck:
    """The check a resume makes before it appends (the launcher's, before any rank starts): for
    every rank, the parts committed after its index and the newest indexed part (what the resume
    appends to), and with `after_step` (the step of the checkpoint it resumes from) every part
    whose records go past that step, read back in full (page checksums, schema, the digest in the
    index) unless a check already read them back since they were committed; the entries are then
    marked `checked`, so the ranks' own checks after it read nothing again. Older parts are left
    to their digests in the index (`verify_log` reads every part). A run without an index has
    every part read once and the index built. ValueError naming the first damaged part. With
    `mark=False` nothing is written (the same parts are read again by the next check, unless it
    is handed this check's `verified` as `known`)."""
    check = LogCheck()
    directory = audit_dir(run_dir)
    if not directory.is_dir():
        return check
    if mark:
        open_index(run_dir, check)
    elif not index_dir(directory).is_dir():
        check.legacy = True
        for part in part_files(run_dir):
            check.read(part)
        return check
    for rank in index_ranks(directory):
        index = RankIndex.load(directory, rank)
        assert index is not None
        _check_rank(index, check, after_step=after_step, last=True, save=mark, known=known)
    return check


def mark_known(run_dir: str | os.PathLike, rank: int, known: dict[str, list[int | str]]) -> int:
    """Mark `checked` in `rank`'s index the entries `known` (a check's `verified`) holds and that
    are unchanged since (see `_unchanged`), so that rank's writer does not read them again; the
    number marked. Nothing is read but the index and the parts' metadata."""
    directory = audit_dir(run_dir)
    index = RankIndex.load(directory, rank) if index_dir(directory).is_dir() else None
    if index is None:
        return 0
    names = {name for name in known if name.startswith(f"part-r{rank:05d}-")}
    marked = 0
    for entry in index.newest_first():  # the known parts are the tail: only as far back as they go
        if not names:
            break
        name = part_name(rank, entry.part)
        names.discard(name)
        if not entry.checked and _unchanged(directory / name, entry, known):
            index.mark_checked(entry)
            marked += 1
    if marked:
        index.save()
    return marked


def verify_audit_log(run_dir: str | os.PathLike) -> int:
    """Read every complete part of the run's audit log in full, against its digest where the run
    has an index: the number of records (0 without an audit log), or a ValueError naming the
    first damaged part."""
    if not audit_dir(run_dir).is_dir():
        return 0
    result = verify_log(run_dir)
    if result.problems:
        raise ValueError(result.problems[0])
    return result.records


@dataclass
class LogVerification:
    """`verify_log`'s findings: what was read, and one line per problem (empty: the log is intact)."""

    run: str
    parts: int = 0
    records: int = 0
    bytes: int = 0
    indexed: bool = False  # the run has an index (audit/_index/)
    unindexed: list[str] = field(default_factory=list)  # parts after the index: the next open indexes them
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "ok": self.ok,
            "parts": self.parts,
            "records": self.records,
            "bytes": self.bytes,
            "indexed": self.indexed,
            "unindexed": list(self.unindexed),
            "problems": list(self.problems),
        }


def verify_log(run_dir: str | os.PathLike) -> LogVerification:
    """Read every part of the run's audit log in full (page checksums, schema) and check each
    against its entry in the index (size, xxh3-128 of its bytes), every entry against a part that
    exists, every index file readable. Reads only; ValueError when `run_dir` is not a run with an
    audit log (bad input), every finding about the log itself in `problems`."""
    run_dir = Path(run_dir)
    directory = audit_dir(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if not directory.is_dir():
        raise ValueError(f"{run_dir}: not a run with an audit log ({AUDIT_DIR}/ not found)")
    result = LogVerification(str(run_dir), indexed=index_dir(directory).is_dir())
    entries: dict[str, PartEntry] = {}
    for rank in index_ranks(directory):
        try:
            index = RankIndex.load(directory, rank)
            assert index is not None
            entries.update((part_name(rank, e.part), e) for e in index.all_entries())
        except ValueError as error:
            result.problems.append(str(error))
    for part in part_files(run_dir):
        entry = entries.pop(part.name, None)
        if result.indexed and entry is None:
            result.unindexed.append(str(part))
        try:
            reading = verify_part(part, entry)
        except ValueError as error:
            result.problems.append(str(error))
            continue
        result.parts += 1
        result.records += reading.rows
        result.bytes += reading.bytes
    for name in sorted(entries):  # listed, but no such part
        result.problems.append(str(_damaged(directory / name, "", "missing, though listed in the index")))
    return result


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
