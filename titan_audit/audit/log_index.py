"""The audit log's index: per rank, one entry per committed part (its size, records, steps and the
xxh3-128 digest of its bytes), kept in files of bounded size so that a resume reads a constant
amount of it, however long the run.

    RUN/audit/_index/r00000.json               the head: the newest entries of rank 0 (<= SEGMENT)
    RUN/audit/_index/r00000/seg-00000000.json  sealed segments: SEGMENT entries each, oldest first

Guarantees:
- Every index file is written atomically (temp file, rename: titan_audit.atomic), so a kill
  leaves the old or the new version. A commit rewrites the head only (at most SEGMENT entries);
  when the head is full, its entries first become the next sealed segment (fsynced), which is
  never rewritten again except to set `checked` flags. So a run of N parts writes O(N) index
  bytes, and the newest entries are found by reading the head and, going further back, one
  segment at a time (`RankIndex.newest_first`). The head is not fsynced at each commit (that
  would double the cost of a flush): after a power loss it may lack its last entries, whose parts
  are then found after it and read back (below), or be unreadable, which stops a resume naming
  it (moving RUN/audit/_index/ aside makes the next resume read every part once and rebuild it).
- An entry is committed after its part is renamed into place, so a crash between the two leaves a
  part beyond the index (never an entry without its part): `unindexed_parts` finds those by
  probing the part names after the last entry (no directory listing).
- `checked` on an entry: the part's bytes were read back in full and matched the digest (and its
  Parquet page checksums) after it was committed. A part committed by a writer has checked=false.
- The index directory appears atomically, complete for every rank that has parts: `ensure_index`
  builds it under a temporary name and renames it into place (a second builder's rename fails and
  it uses the first one's). A rank's head exists before that rank's first part is written.
- Files that are not an index of this format (bad JSON, another format, another rank) raise a
  ValueError naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_audit.atomic import atomic_output_file, current_umask, write_bytes_atomic

INDEX_DIR = "_index"  # "_": dataset readers of RUN/audit (pyarrow) skip it
FORMAT = "titan-audit-audit-index"
VERSION = 1
SEGMENT = 64  # entries per sealed segment, and at most in the head


@dataclass
class PartEntry:
    """One committed part: `part-r<rank>-<part>.parquet`."""

    part: int
    bytes: int
    rows: int
    first_step: int
    last_step: int
    xxh3: str  # xxh3-128 (hex) of the part file's bytes
    checked: bool = False  # read back in full and matched since it was committed

    @classmethod
    def from_dict(cls, data: Any, source: Path) -> PartEntry:
        try:
            entry = cls(**data)
        except TypeError as error:
            raise ValueError(f"{source}: not an audit-log index entry ({error})") from None
        ints = (entry.part, entry.bytes, entry.rows, entry.first_step, entry.last_step)
        if not all(type(v) is int for v in ints) or not isinstance(entry.xxh3, str):
            raise ValueError(f"{source}: not an audit-log index entry ({data!r})")
        return entry


def index_dir(audit_dir: Path) -> Path:
    return audit_dir / INDEX_DIR


def head_path(root: Path, rank: int) -> Path:
    """The head of `rank` in the index directory `root`."""
    return root / f"r{rank:05d}.json"


def segment_path(root: Path, rank: int, segment: int) -> Path:
    return root / f"r{rank:05d}" / f"seg-{segment:08d}.json"


def part_name(rank: int, part: int) -> str:
    return f"part-r{rank:05d}-{part:08d}.parquet"


def _read_json(path: Path, rank: int, counter: list[int]) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: the audit log's index cannot be read ({error.strerror})") from None
    counter[0] += len(raw)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: the audit log's index is damaged (not valid JSON: {error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("parts"), list):
        raise ValueError(f"{path}: not an audit-log index file (format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: audit-log index version {data.get('version')!r}; this titan-audit reads {VERSION}")
    if data.get("rank") != rank:
        raise ValueError(f"{path}: an index of rank {data.get('rank')!r}, expected rank {rank}")
    return data


def _dump(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


def _segment_body(rank: int, k: int, entries: list[PartEntry]) -> bytes:
    return _dump(
        {"format": FORMAT, "version": VERSION, "rank": rank, "segment": k, "parts": [vars(e) for e in entries]}
    )


def _head_body(rank: int, sealed: int, entries: list[PartEntry]) -> bytes:
    return _dump(
        {"format": FORMAT, "version": VERSION, "rank": rank, "sealed": sealed, "parts": [vars(e) for e in entries]}
    )


class RankIndex:
    """One rank's index (see the module docstring); `bytes_read` counts the index bytes read."""

    def __init__(self, audit_dir: Path, rank: int) -> None:
        self.audit_dir = Path(audit_dir)
        self.root = index_dir(self.audit_dir)
        self.rank = rank
        self.sealed = 0  # number of sealed segments
        self.head: list[PartEntry] = []
        self._segments: dict[int, list[PartEntry]] = {}
        self._dirty: set[int | None] = set()  # None: the head; k: sealed segment k
        self._read = [0]

    @property
    def bytes_read(self) -> int:
        return self._read[0]

    @property
    def path(self) -> Path:
        return head_path(self.root, self.rank)

    @classmethod
    def load(cls, audit_dir: Path, rank: int) -> RankIndex | None:
        """The rank's index, None when it has no head."""
        index = cls(audit_dir, rank)
        if not index.path.is_file():
            return None
        data = _read_json(index.path, rank, index._read)
        sealed = data.get("sealed")
        if type(sealed) is not int or sealed < 0:
            raise ValueError(f"{index.path}: not an audit-log index file (bad 'sealed': {sealed!r})")
        index.sealed = sealed
        index.head = [PartEntry.from_dict(e, index.path) for e in data["parts"]]
        return index

    def segment(self, k: int) -> list[PartEntry]:
        if k not in self._segments:
            path = segment_path(self.root, self.rank, k)
            data = _read_json(path, self.rank, self._read)
            if data.get("segment") != k or len(data["parts"]) != SEGMENT:
                raise ValueError(f"{path}: not sealed segment {k} of {SEGMENT} entries")
            self._segments[k] = [PartEntry.from_dict(e, path) for e in data["parts"]]
        return self._segments[k]

    def newest_first(self) -> Iterator[PartEntry]:
        """Every entry, newest first, reading sealed segments only as far back as iterated."""
        yield from reversed(self.head)
        for k in range(self.sealed - 1, -1, -1):
            yield from reversed(self.segment(k))

    def all_entries(self) -> list[PartEntry]:
        """Every entry, oldest first (reads every segment)."""
        return [e for k in range(self.sealed) for e in self.segment(k)] + list(self.head)

    def next_part(self) -> int:
        """The number after the last entry's part (0 when the rank has none)."""
        if self.head:
            return self.head[-1].part + 1
        if self.sealed:
            return self.segment(self.sealed - 1)[-1].part + 1
        return 0

    def unindexed_parts(self) -> list[int]:
        """The parts of this rank present after the last entry: committed, but the index not yet
        (a crash between the rename and the index write); found by probing names in order."""
        found = []
        n = self.next_part()
        while (self.audit_dir / part_name(self.rank, n)).is_file():
            found.append(n)
            n += 1
        return found

    def mark_checked(self, entry: PartEntry) -> None:
        """Set `checked` on an entry the caller read back (written by `save`)."""
        entry.checked = True
        if any(e is entry for e in self.head):
            self._dirty.add(None)
            return
        for k, entries in self._segments.items():
            if any(e is entry for e in entries):
                self._dirty.add(k)
                return
        raise AssertionError(f"part {entry.part} is not in rank {self.rank}'s index")

    def add(self, entry: PartEntry) -> None:
        """Append an entry (written by `save`); a full head becomes the next sealed segment first."""
        assert entry.part >= self.next_part(), f"part {entry.part} is not after rank {self.rank}'s last entry"
        if len(self.head) == SEGMENT:
            self._segments[self.sealed] = self.head
            self._dirty.add(self.sealed)
            self.sealed += 1
            self.head = []
        self.head.append(entry)
        self._dirty.add(None)

    def save(self) -> None:
        """Write what changed: the sealed segments first, the head last (it names how many)."""
        for k in sorted(k for k in self._dirty if k is not None):
            body = _segment_body(self.rank, k, self._segments[k])
            write_bytes_atomic(segment_path(self.root, self.rank, k), body, overwrite=True)
        if None in self._dirty or not self.path.is_file():
            with atomic_output_file(self.path, overwrite=True) as tmp:  # no fsync: see the module docstring
                tmp.write_bytes(_head_body(self.rank, self.sealed, self.head))
        self._dirty.clear()


def index_ranks(audit_dir: Path) -> list[int]:
    """The ranks with a head in the index, in order."""
    root = index_dir(audit_dir)
    names = [p.name for p in root.iterdir()] if root.is_dir() else []
    return sorted(
        int(n[1:6]) for n in names if len(n) == 11 and n[0] == "r" and n[1:6].isdigit() and n.endswith(".json")
    )


def ensure_index(audit_dir: Path, build: dict[int, list[PartEntry]]) -> bool:
    """Create RUN/audit/_index/ atomically with one complete index (segments and head) per rank of
    `build` (entries oldest first), unless it exists; True when this call created it."""
    root = index_dir(audit_dir)
    if root.is_dir():
        return False
    tmp = Path(tempfile.mkdtemp(prefix=f".{INDEX_DIR}.", suffix=".tmp", dir=audit_dir))
    try:
        for rank, entries in sorted(build.items()):
            full = (len(entries) - 1) // SEGMENT if entries else 0  # the head keeps 1..SEGMENT entries
            for k in range(full):
                body = _segment_body(rank, k, entries[k * SEGMENT : (k + 1) * SEGMENT])
                write_bytes_atomic(segment_path(tmp, rank, k), body)
            write_bytes_atomic(head_path(tmp, rank), _head_body(rank, full, entries[full * SEGMENT :]))
        os.chmod(tmp, 0o777 & ~current_umask())
        try:
            os.rename(tmp, root)
        except OSError:
            if root.is_dir():  # another builder was first: its index stands
                return False
            raise
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
