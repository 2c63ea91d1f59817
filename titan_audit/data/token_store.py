"""Zarr v3 token stores: one 1-D token array plus document offsets.

Layout (a zarr v3 group on the local file system):
    attrs    format="titan-audit.tokens.v1", tokenizer (identity), vocab_size, eos_id, pad_id,
             num_docs, num_tokens, origin (the source manifest it was prepared from, or null)
    tokens   1-D uint16 (vocab <= 65536) or uint32, chunks of CHUNK_TOKENS, zstd level 3
    offsets  1-D int64, num_docs + 1 entries; document d is tokens[offsets[d]:offsets[d+1]]

Guarantees: the writer's output bytes are a function of the appended documents alone (no
timestamps, fixed codecs and chunking), so equal inputs give byte-identical stores. `open` checks
the format and the invariants (offsets start at 0, never decrease, end at len(tokens)) and raises
ValueError naming the store and the key at fault. Offsets are loaded into memory once (8 bytes per
document: the dataset's index, identical on every rank); tokens are read on demand by range,
chunk by chunk through a small LRU cache of decoded chunks; for the layout this writer makes, a
chunk is decoded straight from its file (`_direct_reader`), zarr's own path otherwise. A store
is written under its output's lock (`store_output_lock`: `.NAME.lock` next to it), which refuses
a second writer of the same store and removes what a killed writer left (`.NAME.XXXX.tmp`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from titan_audit.data.manifest import FileEntry, SourceManifest, hash_file
from titan_audit.log import get_logger

log = get_logger(__name__)

FORMAT = "titan-audit.tokens.v1"
CHUNK_TOKENS = 1 << 16
CHUNK_OFFSETS = 1 << 16
_CODEC = ZstdCodec(level=3)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class _Appender:
    """Append to a 1-D zarr array, writing whole chunks only (one resize per flush)."""

    def __init__(self, array: zarr.Array, chunk: int) -> None:
        self.array, self.chunk, self.length = array, chunk, 0
        self.pending: list[np.ndarray] = []
        self.pending_len = 0

    def append(self, values: np.ndarray) -> None:
        self.pending.append(values)
        self.pending_len += len(values)
        if self.pending_len >= self.chunk:
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        if not self.pending_len:
            return
        data = np.concatenate(self.pending).astype(self.array.dtype, copy=False)
        n = len(data) if final else (len(data) // self.chunk) * self.chunk
        if n:
            self.array.resize((self.length + n,))
            self.array[self.length : self.length + n] = data[:n]
            self.length += n
        rest = data[n:]
        self.pending, self.pending_len = ([rest] if len(rest) else []), len(rest)


class TokenStoreWriter:
    """Writes a token store into `path` (a fresh directory; callers make it atomic)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tokenizer: str,
        vocab_size: int,
        eos_id: int,
        pad_id: int,
        origin: SourceManifest | None,
    ) -> None:
        self.path = Path(path)
        self.group = zarr.open_group(store=str(self.path), mode="w", zarr_format=3)
        self.attrs: dict[str, Any] = {
            "format": FORMAT,
            "tokenizer": tokenizer,
            "vocab_size": int(vocab_size),
            "eos_id": int(eos_id),
            "pad_id": int(pad_id),
            "origin": origin.to_dict() if origin is not None else None,
        }
        dtype = token_dtype(vocab_size)
        tokens = self.group.create_array(
            "tokens", shape=(0,), chunks=(CHUNK_TOKENS,), dtype=dtype, compressors=_CODEC, fill_value=0
        )
        offsets = self.group.create_array(
            "offsets", shape=(0,), chunks=(CHUNK_OFFSETS,), dtype=np.int64, compressors=_CODEC, fill_value=0
        )
        self._tokens = _Appender(tokens, CHUNK_TOKENS)
        self._offsets = _Appender(offsets, CHUNK_OFFSETS)
        self._offsets.append(np.zeros(1, dtype=np.int64))
        self.num_docs = 0
        self.num_tokens = 0
        self.max_id = np.iinfo(dtype).max

    def append(self, docs: list[np.ndarray]) -> None:
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate(docs) if len(docs) > 1 else np.asarray(docs[0])
        if flat.size and int(flat.max()) > self.max_id:
            raise ValueError(f"token id {int(flat.max())} does not fit the store's dtype (max {self.max_id})")
        self._tokens.append(flat)
        self._offsets.append(self.num_tokens + np.cumsum(lengths))
        self.num_docs += len(docs)
        self.num_tokens += int(lengths.sum())

    def close(self) -> None:
        self._tokens.flush(final=True)
        self._offsets.flush(final=True)
        assert self._tokens.length == self.num_tokens and self._offsets.length == self.num_docs + 1
        self.group.attrs.update({**self.attrs, "num_docs": self.num_docs, "num_tokens": self.num_tokens})


@contextlib.contextmanager
def store_output_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold the lock of token store output `path` (atomic.output_lock) while it is written: a
    second writer is refused, and the temporaries (`.NAME.XXXX.tmp`) a killed writer left are
    removed first, each named in an INFO log line."""
    from titan_audit.atomic import output_lock

    with output_lock(path) as removed:
        for stale in removed:
            log.info("removed %s: left by an interrupted write of %s", stale, path)
        yield


def write_token_store(
    path: str | os.PathLike,
    docs: list[np.ndarray],
    *,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    tokenizer: str = "custom",
    origin: SourceManifest | None = None,
    overwrite: bool = False,
) -> Path:
    """Write already-tokenized documents as a token store, atomically (tests, small tools)."""
    from titan_audit.atomic import atomic_output_dir

    with store_output_lock(path), atomic_output_dir(path, overwrite=overwrite) as tmp:
        writer = TokenStoreWriter(
            tmp, tokenizer=tokenizer, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, origin=origin
        )
        writer.append([np.asarray(d, dtype=np.uint32) for d in docs])
        writer.close()
    return Path(path)


@dataclass(frozen=True)
class StoreInfo:
    path: str
    tokenizer: str
    vocab_size: int
    eos_id: int
    pad_id: int
    num_docs: int
    num_tokens: int
    token_dtype: str


class TokenStore:
    """A read-only token store. Thread-safe; cheap to re-open in a worker process."""

    def __init__(self, path: str | os.PathLike, *, cache_chunks: int = 64) -> None:
        self.path = Path(path)
        where = str(self.path)
        if not (self.path / "zarr.json").is_file():
            raise ValueError(f"{where}: not a token store (no zarr.json; run `titan-audit data prepare` first)")
        try:
            group = zarr.open_group(store=where, mode="r", zarr_format=3)
            attrs = dict(group.attrs)
        except Exception as error:  # zarr raises many types for a broken store
            raise ValueError(f"{where}: corrupt zarr store ({error})") from None
        if attrs.get("format") != FORMAT:
            raise ValueError(f"{where}: attribute 'format' is {attrs.get('format')!r}, expected {FORMAT!r}")
        for key in ("tokenizer", "vocab_size", "eos_id", "pad_id", "num_docs", "num_tokens"):
            if key not in attrs:
                raise ValueError(f"{where}: missing attribute {key!r}")
        arrays = {}
        for key in ("tokens", "offsets"):
            try:
                arrays[key] = group[key]
            except Exception as error:
                raise ValueError(f"{where}: missing or corrupt array {key!r} ({error})") from None
            if not isinstance(arrays[key], zarr.Array) or arrays[key].ndim != 1:
                raise ValueError(f"{where}: {key!r} must be a 1-D array")
        self.tokens_array: zarr.Array = arrays["tokens"]
        num_docs, num_tokens = int(attrs["num_docs"]), int(attrs["num_tokens"])
        if self.tokens_array.shape[0] != num_tokens:
            raise ValueError(
                f"{where}: 'tokens' has {self.tokens_array.shape[0]} entries, attribute num_tokens says {num_tokens}"
            )
        if arrays["offsets"].shape[0] != num_docs + 1:
            raise ValueError(
                f"{where}: 'offsets' has {arrays['offsets'].shape[0]} entries, expected num_docs + 1 = {num_docs + 1}"
            )
        try:
            self.offsets = np.asarray(arrays["offsets"][:], dtype=np.int64)
        except Exception as error:
            raise ValueError(f"{where}: cannot read 'offsets' ({error})") from None
        if self.offsets[0] != 0 or self.offsets[-1] != num_tokens or (num_docs and np.any(np.diff(self.offsets) < 0)):
            raise ValueError(f"{where}: 'offsets' must start at 0, never decrease and end at num_tokens={num_tokens}")
        if num_docs == 0:
            raise ValueError(f"{where}: the store holds no documents")
        self.info = StoreInfo(
            where,
            str(attrs["tokenizer"]),
            int(attrs["vocab_size"]),
            int(attrs["eos_id"]),
            int(attrs["pad_id"]),
            num_docs,
            num_tokens,
            str(self.tokens_array.dtype),
        )
        origin = attrs.get("origin")
        self.origin = SourceManifest.from_dict(origin, source=f"{where} attribute 'origin'") if origin else None
        self.chunk = int(self.tokens_array.chunks[0])
        self._direct = _direct_reader(self.path / "tokens", self.tokens_array.dtype, self.chunk)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_size = cache_chunks
        self._lock = threading.Lock()

    @property
    def num_docs(self) -> int:
        return self.info.num_docs

    @property
    def num_tokens(self) -> int:
        return self.info.num_tokens

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def _chunk(self, index: int) -> np.ndarray:
        with self._lock:
            data = self._cache.get(index)
            if data is not None:
                self._cache.move_to_end(index)
                return data
        start = index * self.chunk
        stop = min(start + self.chunk, self.num_tokens)
        try:
            data = self._direct(index)[: stop - start] if self._direct else self.tokens_array[start:stop]
        except Exception as error:
            raise ValueError(f"{self.path}: cannot read 'tokens' chunk {index} ({error})") from None
        with self._lock:
            self._cache[index] = data
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return data

    def read(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] in the store's dtype (through a small LRU cache of decoded chunks)."""
        assert 0 <= start <= stop <= self.num_tokens, (start, stop, self.num_tokens)
        first, last = start // self.chunk, (stop - 1) // self.chunk if stop > start else start // self.chunk
        if stop == start:
            return np.empty(0, dtype=self.tokens_array.dtype)
        parts = [self._chunk(i) for i in range(first, last + 1)]
        data = parts[0] if len(parts) == 1 else np.concatenate(parts)
        base = first * self.chunk
        return data[start - base : stop - base]

    def doc(self, index: int) -> np.ndarray:
        return self.read(int(self.offsets[index]), int(self.offsets[index + 1]))

    def manifest(self) -> SourceManifest:
        return store_manifest(self.path, self.origin)


def _direct_reader(array_dir: Path, dtype: np.dtype, chunk: int):
    """A fast path around zarr's async machinery for the one layout the writer makes.

    When the array's metadata is exactly ours (regular 1-D chunks, default "/" chunk keys, codecs
    bytes(little endian) then zstd, fill value 0, no storage transformers), a chunk is the zstd
    frame in file `c/<i>`, decoded here with the same codec zarr uses; a missing chunk file is the
    fill value, as in zarr. Any other layout returns None and reads go through zarr. The result is
    the same array either way (tests compare both paths on every chunk).
    """
    from numcodecs.zstd import Zstd

    try:
        meta = json.loads((array_dir / "zarr.json").read_text())
        ours = (
            meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "/"}}
            and [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
            and meta["codecs"][0].get("configuration", {}).get("endian") == "little"
            and meta["fill_value"] == 0
            and not meta.get("storage_transformers")
            and meta["chunk_grid"]["configuration"]["chunk_shape"] == [chunk]
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if not ours:
        return None
    codec = Zstd()
    little = np.dtype(dtype).newbyteorder("<")

    def read(index: int) -> np.ndarray:
        try:
            raw = (array_dir / "c" / str(index)).read_bytes()
        except FileNotFoundError:
            return np.zeros(chunk, dtype=dtype)
        data = np.frombuffer(codec.decode(raw), dtype=little)
        if data.shape[0] != chunk:
            raise ValueError(f"chunk {index} decodes to {data.shape[0]} elements, expected {chunk}")
        return data.astype(dtype, copy=False)

    return read


def store_manifest(path: str | os.PathLike, origin: SourceManifest | None = None) -> SourceManifest:
    """Manifest of every file of a token store; rows = elements of a chunk file, 0 for metadata."""
    path = Path(path)
    shapes: dict[str, tuple[int, int]] = {}
    for key in ("tokens", "offsets"):
        meta_path = path / key / "zarr.json"
        if meta_path.is_file():
            try:
                meta = json.loads(meta_path.read_text())
                shapes[key] = (int(meta["shape"][0]), int(meta["chunk_grid"]["configuration"]["chunk_shape"][0]))
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"{path}: corrupt metadata {key}/zarr.json") from None
    entries = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        rows = 0
        parts = name.split("/")
        if len(parts) == 3 and parts[0] in shapes and parts[1] == "c" and parts[2].isdigit():
            length, chunk = shapes[parts[0]]
            rows = max(0, min(chunk, length - int(parts[2]) * chunk))
        size, digest = hash_file(file)
        entries.append(FileEntry(name, size, rows, digest))
    return SourceManifest("zarr", tuple(entries), origin=origin)
