"""The two 64-bit lanes of the audit's order-free tensor digest, on our compiled kernel
(`kernels/lattice.cpp`; audit/fingerprint.py defines the digest on top of them).

Guarantee: `rows(...)` adds to `lanes`, modulo 2^64, one term per word x_j it is given (1, 2 or 4
bytes, zero-extended to 32 bits) that depends only on the word and its global word index j:
- version 2 (`VERSION`, blocked): lane L += B_L(floor(j / 4096)) * ((x_j ^ X_L) * T_L[j mod 4096]),
  the inner product exact in 64 bits, T_L a table of 4096 odd 32-bit keys and B_L(b) an odd 64-bit
  key per block of 4096 words (both from the bijections F_0, F_1);
- version 1 (mixed; what `hashes.json` format 2 holds): lane L += F_L(u_j ^ K_L) with u_j =
  ((j mod 2^32) << 32 | x_j) ^ (floor(j / 2^32) * KH).
Constants and F_0, F_1 (MurmurHash3's and splitmix64's finalisers) are in kernels/lattice.cpp.
Integer addition modulo 2^64 does not depend on order (and B_L distributes over it), so the lanes
are the same on every CPU, ISA variant and thread count, and the lanes of disjoint pieces, added,
are the lanes of their union. `reference_lanes` is the same function in numpy (slow; for tests and
the bench). The version in use is `version()`: `VERSION` unless `using_version` says otherwise
(only to check digests written with version 1).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from titan_audit.batch_invariant.cpu import _lib

WORD_BYTES = (1, 2, 4)
VERSIONS = (1, 2)
VERSION = 2
# as in kernels/lattice.cpp (with F0, F1 below)
K0, K1, KH = 0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D1
KT0, KT1, X0, X1 = 0x082EFA98EC4E6C89, 0x452821E638D01377, 0xBE5466CF, 0x34E90C6C
BLOCK = 4096
BLOCK_SHIFT = BLOCK.bit_length() - 1  # j >> BLOCK_SHIFT is word j's block
assert 1 << BLOCK_SHIFT == BLOCK
# The word dtypes the device paths read (a word zero-extended: its value & the mask).
WORD_MASK = {torch.uint8: 0xFF, torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}
MASK = (1 << 64) - 1

_version = VERSION


def version() -> int:
    """The lattice version `rows` and `span` compute (and audit/fingerprint.py keys digests by)."""
    return _version


@contextlib.contextmanager
def using_version(v: int) -> Iterator[None]:
    """Compute version `v`'s lanes inside (to check digests written with it)."""
    global _version
    if v not in VERSIONS:
        raise ValueError(f"lattice: unknown digest version {v!r}; this titan-audit knows {VERSIONS}")
    saved, _version = _version, v
    try:
        yield
    finally:
        _version = saved


_lib.declare(
    "lattice_rows",
    None,
    [
        ctypes.c_int32,  # version
        ctypes.c_void_p,  # base
        ctypes.c_int32,  # word width in bytes
        ctypes.c_int64,  # rows
        ctypes.c_int64,  # words per row
        ctypes.c_void_p,  # int64 word offset of each row from base
        ctypes.c_void_p,  # int64 global word index of each row's first word
        ctypes.c_int32,  # threads
        ctypes.c_void_p,  # uint64 lanes[2], added to
    ],
)

Lanes = ctypes.c_uint64 * 2


def new_lanes() -> ctypes.Array:
    return Lanes(0, 0)


def rows(
    lanes: ctypes.Array,
    base: int,
    width: int,
    run: int,
    local: torch.Tensor,
    global_start: torch.Tensor,
    threads: int = 1,
) -> None:
    """lanes += the lanes of len(local) rows of `run` words of `width` bytes: row r is at word
    offset local[r] from address `base` and at global word indices global_start[r], ... (both
    contiguous int64 CPU tensors). `threads` splits the words (the result does not depend on it)."""
    if width not in WORD_BYTES:
        raise ValueError(f"lattice: word width must be one of {WORD_BYTES}, got {width}")
    assert local.dtype == global_start.dtype == torch.int64 and local.is_contiguous() and global_start.is_contiguous()
    assert local.numel() == global_start.numel()
    if run and local.numel():
        _lib.kernel("lattice_rows")(
            _version, base, width, local.numel(), run, local.data_ptr(), global_start.data_ptr(), max(1, threads), lanes
        )


def span(lanes: ctypes.Array, address: int, width: int, words: int, first_index: int, threads: int = 1) -> None:
    """lanes += the lanes of `words` consecutive words of `width` bytes at `address`, at global
    word indices first_index, first_index + 1, ... (one row, no index tables to build)."""
    if width not in WORD_BYTES:
        raise ValueError(f"lattice: word width must be one of {WORD_BYTES}, got {width}")
    if words:
        local, first = ctypes.c_int64(0), ctypes.c_int64(first_index)
        _lib.kernel("lattice_rows")(
            _version, address, width, 1, words, ctypes.addressof(local), ctypes.addressof(first), max(1, threads), lanes
        )


def _finalise(x: np.ndarray, s1: int, m1: int, s2: int, m2: int, s3: int) -> np.ndarray:
    """x ^= x >> s1; x *= m1; x ^= x >> s2; x *= m2; x ^= x >> s3 (modulo 2^64)."""
    x = x ^ (x >> np.uint64(s1))
    x = x * np.uint64(m1)
    x = x ^ (x >> np.uint64(s2))
    x = x * np.uint64(m2)
    return x ^ (x >> np.uint64(s3))


F0 = (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)  # MurmurHash3's fmix64
F1 = (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)  # splitmix64's finaliser


def tables() -> tuple[np.ndarray, np.ndarray]:
    """Version 2's key tables T_0, T_1 (uint64 arrays of 4096 odd values below 2^32)."""
    t = np.arange(BLOCK, dtype=np.uint64)
    return tuple(
        (_finalise(t ^ np.uint64(k), *f) & np.uint64(0xFFFFFFFF)) | np.uint64(1) for k, f in ((KT0, F0), (KT1, F1))
    )


_device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def tables_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`tables()` as int64 tensors on `device` (the device paths' copy, made once per device)."""
    found = _device_tables.get(device)
    if found is None:
        found = _device_tables.setdefault(
            device, tuple(torch.from_numpy(t.astype(np.int64)).to(device) for t in tables())
        )
    return found


def add_lanes(values: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Lanes of disjoint pieces -> lanes of their union (addition modulo 2^64; each value may be
    a lane's uint64 or the int64 with its bits)."""
    return sum(v[0] for v in values) & MASK, sum(v[1] for v in values) & MASK


def to_signed(value: int) -> int:
    """A uint64 as the int64 with its bits (what an int64 tensor can carry)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def sent_to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: through pinned memory, a
    copy that does not block (a copy from pageable memory may wait for the stream). On the CPU
    the tensor itself."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def block_keys(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Version 2's block keys B_0(b), B_1(b) (odd uint64) of the block numbers `blocks` (uint64)."""
    with np.errstate(over="ignore"):
        return (
            _finalise(blocks ^ np.uint64(K0), *F0) | np.uint64(1),
            _finalise(blocks ^ np.uint64(K1), *F1) | np.uint64(1),
        )


def reference_lanes(words: np.ndarray, indices: np.ndarray, v: int | None = None) -> tuple[int, int]:
    """The lanes (version `v`, default `version()`) of unsigned `words` (uint8/16/32) at global
    word `indices`, in numpy (module doc)."""
    v = _version if v is None else v
    with np.errstate(over="ignore"):
        x = words.astype(np.uint64)
        j = indices.astype(np.uint64)
        if v == 1:
            u = ((j << np.uint64(32)) | x) ^ ((j >> np.uint64(32)) * np.uint64(KH))
            a = int(_finalise(u ^ np.uint64(K0), *F0).sum(dtype=np.uint64))
            b = int(_finalise(u ^ np.uint64(K1), *F1).sum(dtype=np.uint64))
            return a, b
        t0, t1 = tables()
        block, offset = j // np.uint64(BLOCK), (j % np.uint64(BLOCK)).astype(np.int64)
        b0, b1 = block_keys(block)
        a = int((b0 * ((x ^ np.uint64(X0)) * t0[offset])).sum(dtype=np.uint64))
        b = int((b1 * ((x ^ np.uint64(X1)) * t1[offset])).sum(dtype=np.uint64))
    return a, b
