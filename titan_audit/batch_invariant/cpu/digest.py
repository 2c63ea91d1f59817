"""xxh3-128 of many (header, bytes) pairs in one call of our compiled kernel (`kernels/digest.cpp`),
on several threads: the audit's fingerprint of tensors of at most C bytes, a batch at a time.

Guarantee: `xxh3_128_many(headers, addresses, nbytes, threads)[i]` is the hexdigest that
python-xxhash's `xxh3_128(headers[i]).update(<nbytes[i] bytes at addresses[i]>)` gives (the same
xxHash 0.8 function, seed 0), for every thread count and ISA variant. The caller keeps the memory
alive and unchanged during the call.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from itertools import accumulate

from titan_audit.batch_invariant.cpu import _lib

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
