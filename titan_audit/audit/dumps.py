"""Full tensor values for chosen records: the zarr v3 group RUN/dumps.zarr.

Guarantees:
- A dump reads back bitwise: `read_dump` returns a tensor with the dtype, shape and bytes that
  were dumped. Dtypes numpy has are stored as themselves; the others (bfloat16, float8, ...)
  are stored as the unsigned-integer view of the same width (bf16 -> uint16), never through a
  float conversion; the torch dtype is in the array's attributes.
- Arrays are chunked (about 1 MiB chunks) and zstd-compressed.
- Layout: `dumps.zarr/step_<step>/<phase>.mb<microbatch>.<name>` ("/" in a name written as
  "%2F"). Attributes: step, phase, microbatch, name, torch_dtype, shape, hash (our fingerprint),
  complete. `complete` is set last, after every chunk is written, so a dump cut short by a crash
  is recognised and never read as data.
- A dump is never overwritten: writing a key that is already dumped with the same hash is a
  no-op (a resumed run replaying a step); with another hash it raises ValueError.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import numpy as np
import torch
import zarr

from titan_audit.audit.fingerprint import fingerprint
from titan_audit.audit.summary import dtype_name, plain_cpu

DUMPS_DIR = "dumps.zarr"
CHUNK_BYTES = 1 << 20

_NUMPY_NATIVE = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
}
_UINT_OF_WIDTH = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in a dump's attributes")
    return dtype


def array_path(step: int, phase: str, microbatch: int, name: str) -> str:
    return f"step_{step}/{phase}.mb{microbatch}.{quote(name, safe='')}"


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunk along the leading dimension so a chunk holds about CHUNK_BYTES."""
    if not shape:
        return ()
    row = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    return (max(1, min(shape[0], CHUNK_BYTES // row)), *shape[1:]) if shape[0] else (1, *shape[1:])


def open_dumps(run_dir: str | os.PathLike, mode: str = "r") -> zarr.Group:
    path = Path(run_dir) / DUMPS_DIR
    if mode == "r" and not path.is_dir():
        raise ValueError(f"{run_dir}: no tensor dumps ({DUMPS_DIR} not found)")
    return zarr.open_group(str(path), mode=mode, zarr_format=3)


class DumpWriter:
    """Writes full tensor values into RUN/dumps.zarr (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.group = open_dumps(run_dir, mode="a")

    def write(self, step: int, phase: str, microbatch: int, name: str, tensor: torch.Tensor) -> str:
        """Dump `tensor` under the record key; returns the array path inside dumps.zarr."""
        plain = plain_cpu(tensor)
        digest = fingerprint(plain)
        path = array_path(step, phase, microbatch, name)
        if path in self.group:
            existing = self.group[path]
            if existing.attrs.get("complete") and existing.attrs.get("hash") == digest:
                return path
            raise ValueError(
                f"{self.group.store}/{path}: already dumped with other contents; dumps are never overwritten"
            )
        if plain.dtype in _NUMPY_NATIVE:
            stored = plain
        else:
            stored = plain.view(_UINT_OF_WIDTH[plain.element_size()])
        values = stored.numpy()
        array = self.group.create_array(
            path,
            shape=values.shape,
            dtype=values.dtype,
            chunks=_chunks(values.shape, values.dtype.itemsize) if values.ndim else "auto",
            compressors=zarr.codecs.ZstdCodec(level=3),
            attributes={
                "step": step,
                "phase": phase,
                "microbatch": microbatch,
                "name": name,
                "torch_dtype": dtype_name(plain.dtype),
                "shape": list(plain.shape),
                "hash": digest,
                "complete": False,
            },
        )
        if values.ndim == 0:
            array[()] = values
        elif values.size:
            array[...] = values
        array.attrs["complete"] = True
        return path


def has_dump(run_dir: str | os.PathLike, step: int, phase: str, microbatch: int, name: str) -> bool:
    if not (Path(run_dir) / DUMPS_DIR).is_dir():
        return False
    group = open_dumps(run_dir)
    path = array_path(step, phase, microbatch, name)
    return path in group and bool(group[path].attrs.get("complete"))


def read_dump(run_dir: str | os.PathLike, step: int, phase: str, microbatch: int, name: str) -> torch.Tensor:
    """The dumped tensor for a record key, bitwise as written; ValueError if absent or incomplete."""
    group = open_dumps(run_dir)
    path = array_path(step, phase, microbatch, name)
    if path not in group:
        raise ValueError(f"{Path(run_dir) / DUMPS_DIR}: no dump {path!r}")
    array = group[path]
    attrs = dict(array.attrs)
    if not attrs.get("complete"):
        raise ValueError(f"{Path(run_dir) / DUMPS_DIR}/{path}: incomplete dump (the writer stopped mid-way)")
    values = np.ascontiguousarray(array[...])
    tensor = torch.from_numpy(values.copy()) if values.ndim else torch.tensor(values)
    dtype = _dtype_from_name(attrs["torch_dtype"])
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    tensor = tensor.reshape(attrs["shape"])
    digest = fingerprint(tensor)
    if digest != attrs["hash"]:
        raise ValueError(f"{Path(run_dir) / DUMPS_DIR}/{path}: contents do not match the recorded hash")
    return tensor


def list_dumps(run_dir: str | os.PathLike) -> list[dict]:
    """The attributes of every complete dump of a run (empty when it has no dumps.zarr)."""
    if not (Path(run_dir) / DUMPS_DIR).is_dir():
        return []
    group = open_dumps(run_dir)
    out = []
    for _, step_group in sorted(group.groups()):
        for _, array in sorted(step_group.arrays()):
            attrs = dict(array.attrs)
            if attrs.get("complete"):
                out.append(attrs)
    return out
