"""The two 64-bit lanes of the audit's order-free tensor digest, on our compiled kernel
(`kernels/lattice.cpp`; audit/fingerprint.py defines the digest on top of them).

Guarantee: `rows(...)` adds to `lanes`, modulo 2^64, lane 0 += F0(u_j ^ K0) and lane 1 +=
F1(u_j ^ K1) over the words x_j it is given (1, 2 or 4 bytes, zero-extended) at their global word
indices j, with u_j = ((j mod 2^32) << 32 | x_j) ^ (floor(j / 2^32) * KH) (constants and the two
64-bit bijections F0, F1 in kernels/lattice.cpp). Integer addition modulo 2^64 does not depend
on order, so the lanes are the same on every CPU, ISA variant and thread count, and the lanes
of disjoint pieces, added, are the lanes of their union. `reference_lanes` is the same function
in numpy (slow; for tests and the bench).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from titan_audit.batch_invariant.cpu import _lib

WORD_BYTES = (1, 2, 4)
K0, K1, KH = 0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D1  # as in kernels/lattice.cpp (and F0, F1)
MASK = (1 << 64) - 1

_lib.declare(
    "lattice_rows",
    None,
    [
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
            base, width, local.numel(), run, local.data_ptr(), global_start.data_ptr(), max(1, threads), lanes
        )


def span(lanes: ctypes.Array, address: int, width: int, words: int, first_index: int, threads: int = 1) -> None:
    """lanes += the lanes of `words` consecutive words of `width` bytes at `address`, at global
    word indices first_index, first_index + 1, ... (one row, no index tables to build)."""
    if width not in WORD_BYTES:
        raise ValueError(f"lattice: word width must be one of {WORD_BYTES}, got {width}")
    if words:
        local, first = ctypes.c_int64(0), ctypes.c_int64(first_index)
        _lib.kernel("lattice_rows")(
            address, width, 1, words, ctypes.addressof(local), ctypes.addressof(first), max(1, threads), lanes
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


def reference_lanes(words: np.ndarray, indices: np.ndarray) -> tuple[int, int]:
    """The lanes of unsigned `words` (uint8/16/32) at global word `indices`, in numpy (module doc)."""
    with np.errstate(over="ignore"):
        x = words.astype(np.uint64)
        j = indices.astype(np.uint64)
        u = ((j << np.uint64(32)) | x) ^ ((j >> np.uint64(32)) * np.uint64(KH))
        a = int(_finalise(u ^ np.uint64(K0), *F0).sum(dtype=np.uint64))
        b = int(_finalise(u ^ np.uint64(K1), *F1).sum(dtype=np.uint64))
    return a, b
