"""xxh3-128 of many (header, bytes) pairs in one call of our compiled kernel (`kernels/digest.cpp`),
on several threads: the audit's fingerprint of tensors of at most C bytes, a batch at a time.

Guarantees:
- `xxh3_128_many(headers, addresses, nbytes, threads)[i]` is the hexdigest that python-xxhash's
  `xxh3_128(headers[i]).update(<nbytes[i] bytes at addresses[i]>)` gives (the same xxHash 0.8
  function, seed 0), for every thread count and ISA variant.
- `xxh3_128_stats(header, address, nbytes, dtype, threads, state)`: that hexdigest of one item,
  and the statistics kernel of `dtype` (batch_invariant/cpu/stats.py) fed the same bytes into
  `state`, the same bits as `stats.update` over them; with two or more threads the hash and the
  statistics run at once, each on its own thread.
The caller keeps the memory alive and unchanged during the call.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from itertools import accumulate

import torch

from titan_audit.batch_invariant.cpu import _lib, stats

_lib.declare(
    "xxh3_128_many",
    None,
    [
        ctypes.c_int64,  # items
        ctypes.c_char_p,  # the headers, concatenated
        ctypes.c_void_p,  # int64 offsets of each header in them (items + 1)
        ctypes.c_void_p,  # uint64 address of each item's bytes
        ctypes.c_void_p,  # int64 byte count of each item
        ctypes.c_int32,  # threads
        ctypes.c_void_p,  # out: 16 bytes per item, each digest in canonical (big-endian) form
    ],
)
_lib.declare(
    "xxh3_128_stats",
    None,
    [
        ctypes.c_char_p,  # header
        ctypes.c_int64,  # its length
        ctypes.c_void_p,  # address of the bytes
        ctypes.c_int64,  # byte count
        ctypes.c_int32,  # statistics kernel: 1 float32, 2 bfloat16, 3 float64
        ctypes.c_int32,  # threads
        ctypes.c_void_p,  # statistics state (stats.new_state), updated
        ctypes.c_void_p,  # out: the digest, canonical (big-endian)
    ],
)
_STATS_KIND = {torch.float32: 1, torch.bfloat16: 2, torch.float64: 3}
assert set(_STATS_KIND) == set(stats.DTYPES), "one kind per statistics kernel"


def xxh3_128_many(
    headers: Sequence[bytes], addresses: Sequence[int], nbytes: Sequence[int], threads: int = 1
) -> list[str]:
    """The hexdigest of each header followed by its bytes (module doc)."""
    n = len(headers)
    if not (len(addresses) == len(nbytes) == n):
        raise ValueError(f"xxh3_128_many: {n} headers, {len(addresses)} addresses, {len(nbytes)} byte counts")
    if n == 0:
        return []
    offsets = array("q", [0])
    offsets.extend(accumulate(map(len, headers)))
    address_array, size_array = array("Q", addresses), array("q", nbytes)
    out = bytearray(16 * n)
    _lib.kernel("xxh3_128_many")(
        n,
        b"".join(headers),
        offsets.buffer_info()[0],
        address_array.buffer_info()[0],
        size_array.buffer_info()[0],
        max(1, threads),
        (ctypes.c_char * (16 * n)).from_buffer(out),
    )
    text = out.hex()
    return [text[i : i + 32] for i in range(0, 32 * n, 32)]


def xxh3_128_stats(
    header: bytes, address: int, nbytes: int, dtype: torch.dtype, threads: int, state: ctypes.Array
) -> str:
    """The hexdigest of `header` followed by the bytes, while the statistics kernel of `dtype`
    (in stats.DTYPES) adds the same bytes, as elements, to `state` (module doc)."""
    kind = _STATS_KIND.get(dtype)
    if kind is None:
        raise TypeError(f"xxh3_128_stats: no statistics kernel for {dtype}; it takes {sorted(map(str, _STATS_KIND))}")
    if nbytes % dtype.itemsize:
        raise ValueError(f"xxh3_128_stats: {nbytes} bytes is not a whole number of {dtype} elements")
    out = (ctypes.c_char * 16)()
    _lib.kernel("xxh3_128_stats")(header, len(header), address, nbytes, kind, max(1, threads), state, out)
    return out.raw.hex()
