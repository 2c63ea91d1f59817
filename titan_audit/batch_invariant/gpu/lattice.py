"""The audit's lattice lanes (version 2, batch_invariant/cpu/lattice.py) of words on a GPU, in one
Triton kernel that reads each word once.

Guarantee: `lanes_on_device(flat, run, local_off, global_off)` gives the two lanes the CPU kernel
gives for the same rows (int64 [2] on the device, the lanes' bits before the mask): row r is `run`
words of `flat` (a 1-d uint8, int16 or int32 view) from local_off[r], at global word indices
global_off[r], global_off[r] + 1, ...; a word is zero-extended from its width. Each program takes
BLOCK consecutive words of one row and adds B_L(j >> 12) * ((x_j ^ X_L) * T_L[j & 4095]) over them
in int64, whose multiplication and sum wrap modulo 2^64 (two's complement): the bits of the
unsigned lane terms. The program partials are added by torch's int64 sum. Integer addition modulo
2^64 does not depend on order, so the lanes do not depend on BLOCK, the grid or the reduction tree.

The sums stay on the device, so that a caller reads many records' lanes in one copy; nothing
here waits for the device (the row offsets go through pinned memory without blocking) once the
block keys it needs exist.

Memory on the device besides the words: 16 bytes per program of partial lanes (one program per
BLOCK <= 4096 words of a row), the key tables T_L (64 KiB) and the block keys B_L of blocks
0 .. the highest block a call reaches (16 bytes per 4096 words), made once on the host and kept
per device, grown when a call needs more. The host sends the row offsets (16 bytes a row).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.cpu import lattice as _cpu
from titan_audit.batch_invariant.gpu._runtime import interpreted, jit

VERSION = 2
MAX_BLOCK = 4096  # words a program reads: at most two lattice blocks' keys per program
_keys: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


@jit
def _lanes_kernel(
    words_ptr,
    local_ptr,
    global_ptr,
    run,
    chunks,
    t0_ptr,
    t1_ptr,
    b0_ptr,
    b1_ptr,
    out_ptr,
    MASK: tl.constexpr,
    X0: tl.constexpr,
    X1: tl.constexpr,
    SHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // chunks
    k = (pid % chunks) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = k < run
    x = tl.load(words_ptr + tl.load(local_ptr + row) + k, mask=inside, other=0).to(tl.int64) & MASK
    j = tl.load(global_ptr + row) + k
    offset = j & ((1 << SHIFT) - 1)
    block = j >> SHIFT
    t0 = tl.load(t0_ptr + offset, mask=inside, other=0)
    t1 = tl.load(t1_ptr + offset, mask=inside, other=0)
    b0 = tl.load(b0_ptr + block, mask=inside, other=0)
    b1 = tl.load(b1_ptr + block, mask=inside, other=0)
    lane0 = tl.sum(tl.where(inside, b0 * ((x ^ X0) * t0), 0), axis=0)
    lane1 = tl.sum(tl.where(inside, b1 * ((x ^ X1) * t1), 0), axis=0)
    tl.store(out_ptr + 2 * pid, lane0)
    tl.store(out_ptr + 2 * pid + 1, lane1)


def _block_keys(device: torch.device, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B_0, B_1 (int64 holding the uint64 bits) of blocks 0 .. n - 1 on `device`, n >= blocks."""
    keys = _keys.get(device)
    if keys is None or keys[0].numel() < blocks:
        have = 0 if keys is None else keys[0].numel()
        n = max(blocks, 2 * have)
        made = _cpu.block_keys(np.arange(n, dtype=np.uint64))
        keys = tuple(torch.from_numpy(k.view(np.int64)).to(device) for k in made)
        _keys[device] = keys
    return keys


def lanes_on_device(flat: torch.Tensor, run: int, local_off: torch.Tensor, global_off: torch.Tensor) -> torch.Tensor:
    """The lanes of the rows (module doc), not read; `local_off` and `global_off` int64, one entry a row."""
    assert flat.dtype in _cpu.WORD_MASK and flat.dim() == 1, "1-d words of one width (device_lanes checks the input)"
    assert _cpu.version() == VERSION, "version 2 lanes only (device_lanes checks the version)"
    device = flat.device
    rows = local_off.numel()
    if rows == 0 or run == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    block = min(MAX_BLOCK, triton.next_power_of_2(run))
    chunks = triton.cdiv(run, block)
    t0, t1 = _cpu.tables_on(device)
    b0, b1 = _block_keys(device, ((int(global_off.max()) + run - 1) >> _cpu.BLOCK_SHIFT) + 1)
    out = torch.empty(rows * chunks, 2, dtype=torch.int64, device=device)
    options = {} if interpreted(flat) else {"num_warps": 4}
    _lanes_kernel[(rows * chunks,)](
        flat,
        _cpu.sent_to(local_off.to(torch.int64), device),
        _cpu.sent_to(global_off.to(torch.int64), device),
        run,
        chunks,
        t0,
        t1,
        b0,
        b1,
        out,
        MASK=_cpu.WORD_MASK[flat.dtype],
        X0=_cpu.X0,
        X1=_cpu.X1,
        SHIFT=_cpu.BLOCK_SHIFT,
        BLOCK=block,
        **options,
    )
    return out.sum(0)
