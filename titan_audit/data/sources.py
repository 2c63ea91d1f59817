"""Text sources: Parquet files with a text column, and JSONL files with a text key.

Guarantees:
- Files are taken in a fixed order: the paths as given, a directory expanded to its matching
  files sorted by relative path. Entry names (in the manifest and in errors) are paths relative to
  the directory given, or the file name for a file given directly; a duplicate name is an error.
- Parquet is read one row group at a time (`read_unit`), never the whole file. JSONL is cut into
  line-aligned byte ranges of about `JSONL_SPLIT_BYTES`, each read on its own.
- The documents of a source, in order, are: for each file, for each unit, the unit's rows in
  file order. That order does not depend on who reads the units or how many readers there are.
- Bad input is a ValueError naming the file (and row group, line or column): a missing file, an
  empty file, a corrupt Parquet file, a missing or non-string text column, a null text value. A
  bad JSONL line is named by file and line number, wherever the unit that reads it starts
  (`corpus.jsonl:3: not UTF-8 (byte 0xe9 at column 17, offset 120 in the file)`, `...:5: not
  valid JSON (MSG: column C)`, `...: no key 'text' in the record`, `...: 'text' is int,
  expected a string`). Lines are read as UTF-8 (a leading BOM is dropped), never guessed.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from titan_audit.data.manifest import FileEntry, SourceManifest, hash_file
from titan_audit.data.textio import line_number, not_utf8

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSONL_SPLIT_BYTES = 4 << 20


@dataclass(frozen=True)
class WorkUnit:
    """One independently readable piece of a source: a Parquet row group or a JSONL byte range."""

    name: str  # the file's entry name
    path: str
    kind: str  # "parquet" or "jsonl"
    index: int  # row group number, or split number
    start: int = 0  # JSONL byte range [start, stop)
    stop: int = 0

    def describe(self) -> str:
        return (
            f"{self.path} row group {self.index}"
            if self.kind == "parquet"
            else f"{self.path} bytes {self.start}-{self.stop}"
        )


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


@dataclass(frozen=True)
class TextSource:
    kind: str
    files: tuple[tuple[str, Path], ...]  # (entry name, path), in source order
    text_column: str

    def manifest(self) -> SourceManifest:
        entries = []
        for name, path in self.files:
            size, digest = hash_file(path)
            entries.append(FileEntry(name, size, _row_count(self.kind, name, path), digest))
        entries.sort(key=lambda e: e.name)
        return SourceManifest(self.kind, tuple(entries), extra={"text_column": self.text_column})

    def units(self) -> list[WorkUnit]:
        out: list[WorkUnit] = []
        for name, path in self.files:
            if self.kind == "parquet":
                count = _parquet_file(name, path).metadata.num_row_groups
                out.extend(WorkUnit(name, str(path), "parquet", i) for i in range(count))
            else:
                for i, (start, stop) in enumerate(_jsonl_splits(path)):
                    out.append(WorkUnit(name, str(path), "jsonl", i, start, stop))
        return out


def open_text_source(paths: str | os.PathLike | list[str | os.PathLike], text_column: str = "text") -> TextSource:
    """Resolve and validate a text source (cheap checks only: existence, schema, first line)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no source paths given")
    files: list[tuple[str, Path]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ValueError(f"{path}: no such file or directory")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind_of(p) is not None)
            if not found:
                raise ValueError(f"{path}: directory holds no .parquet or .jsonl files")
            files.extend((str(p.relative_to(path)), p) for p in found)
        else:
            if _kind_of(path) is None:
                raise ValueError(
                    f"{path}: unknown source type (expected {', '.join(PARQUET_SUFFIXES + JSONL_SUFFIXES)})"
                )
            files.append((path.name, path))
    kinds = {_kind_of(p) for _, p in files}
    if len(kinds) != 1:
        raise ValueError(f"a source must be all Parquet or all JSONL, got both: {', '.join(n for n, _ in files)}")
    names = [n for n, _ in files]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate source file name(s) {', '.join(duplicates)}; give their common directory instead")
    kind = kinds.pop()
    assert kind is not None
    for _, path in files:
        _validate(kind, str(path), path, text_column)
    return TextSource(kind, tuple(files), text_column)


def _parquet_file(name: str, path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as error:
        raise ValueError(f"{name}: not a readable Parquet file ({error})") from None


def _validate(kind: str, name: str, path: Path, text_column: str) -> None:
    if path.stat().st_size == 0:
        raise ValueError(f"{name}: empty file")
    if kind == "parquet":
        meta = _parquet_file(name, path)
        schema = meta.schema_arrow
        if text_column not in schema.names:
            raise ValueError(f"{name}: no text column {text_column!r} (columns: {', '.join(schema.names)})")
        column_type = schema.field(text_column).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise ValueError(f"{name}: column {text_column!r} has type {column_type}, expected string")
        if meta.metadata.num_rows == 0:
            raise ValueError(f"{name}: empty file (0 rows)")
    else:
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        _jsonl_text(line, text_column, offset)
                    except _BadRecord as error:
                        raise ValueError(f"{name}:{number}: {error}") from None
                    return
                offset += len(line)
        raise ValueError(f"{name}: empty file (no records)")


def _row_count(kind: str, name: str, path: Path) -> int:
    if kind == "parquet":
        return _parquet_file(name, path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _jsonl_splits(path: Path) -> list[tuple[int, int]]:
    """Line-aligned byte ranges of about JSONL_SPLIT_BYTES covering the file."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + JSONL_SPLIT_BYTES < size:
            f.seek(bounds[-1] + JSONL_SPLIT_BYTES)
            f.readline()  # to the start of the next line
            position = f.tell()
            if position >= size:
                break
            bounds.append(position)
    bounds.append(size)
    return list(zip(bounds[:-1], bounds[1:]))


class _BadRecord(ValueError):
    """What is wrong with one JSONL line; the caller adds where (`NAME:LINE: ...`)."""


def _jsonl_text(line: bytes, key: str, offset: int | None = None) -> str:
    """The text under `key` of one JSONL line (its bytes; `offset`: where it starts in the file)."""
    if line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8) :]
        offset = offset + len(codecs.BOM_UTF8) if offset is not None else None
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _BadRecord(not_utf8(line, error, offset)) from None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        raise _BadRecord(f"not valid JSON ({error.msg}: column {error.colno})") from None
    if not isinstance(record, dict) or key not in record:
        raise _BadRecord(f"no key {key!r} in the record")
    text = record[key]
    if not isinstance(text, str):
        raise _BadRecord(f"{key!r} is {type(text).__name__}, expected a string")
    return text


def read_unit(unit: WorkUnit, text_column: str) -> list[str]:
    """The documents (texts) of one work unit, in file order."""
    if unit.kind == "parquet":
        try:
            table = _parquet_file(unit.path, Path(unit.path)).read_row_group(unit.index, columns=[text_column])
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{unit.describe()}: corrupt Parquet data ({error})") from None
        column = table.column(text_column)
        if column.null_count:
            first = column.is_null().to_numpy(zero_copy_only=False).argmax()
            raise ValueError(f"{unit.describe()}: null text in column {text_column!r} at row {int(first)} of the group")
        return column.to_pylist()
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.stop - unit.start)
    texts = []
    offset = unit.start
    for raw in data.splitlines(keepends=True):
        line = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith((b"\n", b"\r")) else raw
        if line.strip():
            try:
                texts.append(_jsonl_text(line, text_column, offset))
            except _BadRecord as error:  # the line number is counted only now, on the error path
                raise ValueError(f"{unit.path}:{line_number(unit.path, offset)}: {error}") from None
        offset += len(raw)
    return texts
