"""The lattice lanes of a tensor's words on the device that holds them (a GPU rank's piece): the
digest of a CUDA tensor above C needs no host copy of it. On CUDA, where Triton imports, one
Triton kernel reads each word once (batch_invariant/gpu/lattice.py); otherwise the same lanes in
torch integer ops (below), about 20 kernels over int64 temporaries per slice.

Guarantees:
- `row_lanes(words, run, local_off, global_off)` returns the two lanes that the CPU kernel
  (batch_invariant/cpu/lattice.py, version 2) gives for the same rows: row r is `run` words at
  word offset local_off[r] from `words`' first element and at global word indices
  global_off[r], global_off[r] + 1, ...; each word is zero-extended from its width (the unsigned
  value of a uint8 / int16 / int32 word). The term of word x_j is
  B_L(j / 4096) * ((x_j ^ X_L) * T_L[j mod 4096]) modulo 2^64, computed in int64: (x ^ X) and T
  are below 2^32, so their product and every later product and sum are carried as int64 with the
  bits of the unsigned result, because torch's int64 multiplication and summation wrap modulo
  2^64 (two's complement) on the CPU and on CUDA. tests/audit/test_device_lanes.py checks the
  integers against the CPU kernel on CPU tensors (every word width, rows in and across blocks,
  word indices past 2^32); on a GPU the same ops run on the device.
- Both paths give the CPU kernel's integers: tests/audit/test_device_lanes.py runs each on CPU
  tensors (the Triton kernel in Triton's interpreter) against the CPU kernel. Where the Triton
  kernel cannot be compiled or launched (a GPU or Triton build it does not support), a warning
  says so once per device and the torch ops take over there.
- `lanes_on_device(...)` leaves the two sums on the device (int64 [2], before the mask) for a
  caller that reads many records' lanes in one copy (audit/summary.py `summarize_later`); what
  the host sends (row offsets, block keys) goes through pinned memory without blocking, so
  neither path waits for the device.
- Memory (torch ops): the rows go in slices of at most SLICE_WORDS words, so the temporaries on the device
  are a few int64 tensors of SLICE_WORDS elements whatever the tensor's size (shards.lanes gives
  a block of whole rows as one row, with no per-element index). The host sends each
  slice its block keys (8 bytes per block of 4096 words, per lane); `row_lanes` reads back the
  two lanes once per call.
- Only the current version (2) is computed here; a caller checking version-1 lanes copies the
  piece to the host (shards.lanes).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import numpy as np
import torch

from titan_audit.batch_invariant.cpu import lattice as _kernel

VERSION = 2
SLICE_WORDS = 1 << 21


def _block_keys(first: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """B_0, B_1 of blocks first .. first + count - 1, as int64 (the uint64 bits) on `device`."""
    keys = _kernel.block_keys(np.arange(first, first + count, dtype=np.uint64))
    return tuple(_kernel.sent_to(torch.from_numpy(k.view(np.int64)), device) for k in keys)


def _add_slice(acc: torch.Tensor, words: torch.Tensor, j: torch.Tensor, lowest: int, highest: int) -> None:
    """acc[L] += the lane-L terms of `words` (1-d, one word dtype) at global word indices `j`
    (1-d int64, every value in [lowest, highest])."""
    device = words.device
    x = words.to(torch.int64) & _kernel.WORD_MASK[words.dtype]
    first_block = lowest >> _kernel.BLOCK_SHIFT
    keys = _block_keys(first_block, (highest >> _kernel.BLOCK_SHIFT) - first_block + 1, device)
    offset = j & (_kernel.BLOCK - 1)
    block = (j >> _kernel.BLOCK_SHIFT) - first_block
    for lane, (table, mix) in enumerate(zip(_kernel.tables_on(device), (_kernel.X0, _kernel.X1))):
        acc[lane] += (keys[lane][block] * ((x ^ mix) * table[offset])).sum()


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


_triton_failed: dict[torch.device, str] = {}  # device -> why the Triton kernel could not run there


def _use_triton(words: torch.Tensor) -> bool:
    """Whether `row_lanes` takes the Triton kernel for these words: CUDA words, Triton present."""
    return words.is_cuda and _triton_importable()


def _triton_row_lanes(
    flat: torch.Tensor, run: int, local_off: torch.Tensor, global_off: torch.Tensor
) -> torch.Tensor | None:
    """The Triton kernel's lanes; None (once per device, with a warning) where it cannot be
    compiled or launched there: the torch ops then give the same lanes."""
    from triton.compiler.errors import CompilationError

    from titan_audit.batch_invariant.gpu import lattice as triton_lattice

    try:
        return triton_lattice.lanes_on_device(flat, run, local_off, global_off)
    except (CompilationError, RuntimeError) as error:
        why = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        _triton_failed[flat.device] = why
        warnings.warn(
            f"audit: the Triton lattice kernel cannot run on {flat.device} ({why}); digests there come "
            "from torch integer ops instead (the same digests, more memory traffic)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def row_lanes(words: torch.Tensor, run: int, local_off: torch.Tensor, global_off: torch.Tensor) -> tuple[int, int]:
    """The lanes of the rows of `words` (module doc): `local_off` and `global_off` are int64 CPU
    tensors of one entry per row, `words` a word-dtype view (uint8, int16 or int32) on any device."""
    return read_lanes(lanes_on_device(words, run, local_off, global_off))


def read_lanes(sums: torch.Tensor) -> tuple[int, int]:
    """The two lanes of `lanes_on_device`'s sums, read to the host (one wait for the device)."""
    a, b = sums.tolist()
    return a & _kernel.MASK, b & _kernel.MASK


def lanes_on_device(words: torch.Tensor, run: int, local_off: torch.Tensor, global_off: torch.Tensor) -> torch.Tensor:
    """row_lanes' two sums as int64 [2] on words' device, not read (module doc)."""
    if words.dtype not in _kernel.WORD_MASK:
        raise ValueError(f"device lanes: words must be one of {sorted(map(str, _kernel.WORD_MASK))}, got {words.dtype}")
    if _kernel.version() != VERSION:
        raise ValueError(f"device lanes compute lattice version {VERSION}, not {_kernel.version()}")
    rows = local_off.numel()
    device = words.device
    if rows == 0 or run == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    extent = 1 + int(local_off.max()) + run - 1
    flat = words.as_strided((extent,), (1,))  # the memory the rows lie in, from the first element
    if _use_triton(flat) and device not in _triton_failed:
        lanes = _triton_row_lanes(flat, run, local_off, global_off)
        if lanes is not None:
            return lanes
    acc = torch.zeros(2, dtype=torch.int64, device=device)
    if run >= SLICE_WORDS:  # long rows: each in slices of consecutive words
        for r in range(rows):
            lo, go = int(local_off[r]), int(global_off[r])
            for start in range(0, run, SLICE_WORDS):
                n = min(SLICE_WORDS, run - start)
                j = torch.arange(go + start, go + start + n, dtype=torch.int64, device=device)
                _add_slice(acc, flat[lo + start : lo + start + n], j, go + start, go + start + n - 1)
    else:  # short rows: whole rows per slice
        per = SLICE_WORDS // run
        columns = torch.arange(run, dtype=torch.int64, device=device)
        for r in range(0, rows, per):
            lo, go = local_off[r : r + per], global_off[r : r + per]
            index = (_kernel.sent_to(lo, device)[:, None] + columns).reshape(-1)
            j = (_kernel.sent_to(go, device)[:, None] + columns).reshape(-1)
            _add_slice(acc, flat[index], j, int(go.min()), int(go.max()) + run - 1)
    return acc
