"""Source manifests: what a dataset was made of, file by file, so a changed source is caught.

A `SourceManifest` lists every file of a source with its name (path relative to the source
root), size in bytes, row count (Parquet rows, JSONL records, or elements of a zarr chunk; 0 for
metadata files) and content hash (xxh3-128 of the file's bytes, hex). Entries are sorted by name.
A token store's manifest covers the store's own files and carries, as `origin`, the manifest of
the text files it was prepared from.

`manifest.digest()` is xxh3-128 over a canonical JSON rendering (sorted keys, no whitespace) of
the whole manifest including its origin: equal digests mean the same files with the same bytes.
`check_unchanged(saved, current)` raises ValueError naming the first changed, added or removed
file (origin files first) unless `allow_change=True`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

_BLOCK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    rows: int
    hash: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "rows": self.rows, "hash": self.hash}


@dataclass(frozen=True)
class SourceManifest:
    kind: str  # "parquet", "jsonl" or "zarr"
    entries: tuple[FileEntry, ...]
    origin: SourceManifest | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. text column, tokenizer identity

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        assert names == sorted(names) and len(set(names)) == len(names), "entries must be sorted, unique"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "entries": [e.to_dict() for e in self.entries],
            "origin": self.origin.to_dict() if self.origin is not None else None,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "manifest") -> SourceManifest:
        try:
            origin = data.get("origin")
            return cls(
                kind=str(data["kind"]),
                entries=tuple(
                    FileEntry(str(e["name"]), int(e["size"]), int(e["rows"]), str(e["hash"])) for e in data["entries"]
                ),
                origin=cls.from_dict(origin, source=source) if origin is not None else None,
                extra=dict(data.get("extra") or {}),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"{source}: malformed source manifest ({error!r})") from None

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(self.canonical_json().encode())

    @property
    def total_rows(self) -> int:
        return sum(e.rows for e in self.entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)


def hash_file(path: str | Path) -> tuple[int, str]:
    """(size in bytes, xxh3-128 hex of the bytes), read in 8 MiB blocks."""
    hasher = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return size, hasher.hexdigest()


def differences(saved: SourceManifest, current: SourceManifest, where: str = "") -> list[str]:
    """Human descriptions of how `current` differs from `saved`, origin files first."""
    out: list[str] = []
    if saved.origin is not None or current.origin is not None:
        if saved.origin is None or current.origin is None:
            out.append(
                f"{where}origin: {'absent' if saved.origin is None else 'present'} in the saved manifest, "
                f"{'absent' if current.origin is None else 'present'} now"
            )
        else:
            out.extend(differences(saved.origin, current.origin, where="source file "))
    if saved.kind != current.kind:
        out.append(f"{where}kind {saved.kind!r} != {current.kind!r}")
    if saved.extra != current.extra:
        keys = sorted(k for k in set(saved.extra) | set(current.extra) if saved.extra.get(k) != current.extra.get(k))
        for key in keys:
            out.append(f"{where}setting {key!r}: {saved.extra.get(key)!r} -> {current.extra.get(key)!r}")
    old = {e.name: e for e in saved.entries}
    new = {e.name: e for e in current.entries}
    label = where or "file "
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None:
            out.append(f"{label}{name}: added")
        elif b is None:
            out.append(f"{label}{name}: removed")
        elif a != b:
            what = [
                f"{k} {getattr(a, k)} -> {getattr(b, k)}"
                for k in ("size", "rows", "hash")
                if getattr(a, k) != getattr(b, k)
            ]
            out.append(f"{label}{name}: changed ({', '.join(what)})")
    return out


def check_unchanged(
    saved_digest: str, saved: SourceManifest | None, current: SourceManifest, *, allow_change: bool = False
) -> list[str]:
    """Raise ValueError when the current source is not the one the state was saved with.

    Returns the list of differences (empty when unchanged); with `allow_change=True` a change is
    returned instead of raised, so the caller can log it.
    """
    if current.digest() == saved_digest:
        return []
    diffs = differences(saved, current) if saved is not None else []
    if not diffs:
        diffs = [f"manifest digest {saved_digest} -> {current.digest()}"]
    if allow_change:
        return diffs
    shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
    raise ValueError(
        f"the data source changed since the state was saved: {shown}. Resuming would not continue the "
        "same data; pass allow_source_change=True (--allow-source-change) to resume anyway"
    )
