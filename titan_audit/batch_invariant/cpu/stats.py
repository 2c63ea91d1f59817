"""absmax and sum of a tensor's elements in one pass on our compiled kernel (`kernels/stats.cpp`),
for the audit log's informational `absmax` and `mean` columns (audit/summary.py).

Guarantee: for a plain contiguous CPU tensor of float32, bfloat16 or float64, `absmax_sum`
returns (max |x| as float64, NaN if any element is NaN; the sum of the elements) in the fixed
order written in kernels/stats.cpp: float32 (bfloat16 widened exactly) in blocks of `BLOCK`
elements, 32 float32 lanes per block (lane l adds the block's elements l, l+32, ... in ascending
order), each block's lanes added into 32 float64 lanes, then a fixed tree; float64 straight into
the 32 float64 lanes. So the bits are the same on every CPU, ISA variant (`_lib.forced_isa`) and
thread count, and the same when the elements are fed in consecutive pieces (`update`), each piece
but the last a multiple of `BLOCK` elements long, as in one call. Every NaN it returns is the one
quiet NaN. tests/audit/test_stats_kernel.py re-derives the order in numpy; the kernel battery
(tests/golden/kernels.json, `absmax_sum_*`) pins it on every CPU and on arm64.
"""

from __future__ import annotations

import ctypes

import torch

from titan_audit.batch_invariant.cpu import _lib

LANES = 32  # TA_STATS_LANES in kernels/stats.cpp
BLOCK = 1024  # TA_STATS_BLOCK: pieces fed by `update` (all but the last) are multiples of it
STATE_LEN = LANES + 2  # the lanes, the absmax so far, the lanes' tree sum
KERNELS = {torch.float32: "absmax_sum_f32", torch.bfloat16: "absmax_sum_bf16", torch.float64: "absmax_sum_f64"}
DTYPES = frozenset(KERNELS)

for _name in KERNELS.values():
    _lib.declare(_name, None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])

_State = ctypes.c_double * STATE_LEN
_NEW = _State(*([-0.0] * LANES + [0.0, -0.0]))  # lanes from -0.0 (as every row sum), absmax 0.0


def new_state() -> ctypes.Array:
    """The state of a tensor none of whose elements were fed yet."""
    return _State.from_buffer_copy(_NEW)


def kernel_for(dtype: torch.dtype) -> ctypes._CFuncPtr:
    """The ctypes kernel of `dtype` (in DTYPES), called as (address, count, state) like `update`
    (for callers that feed many pieces and keep the lookup out of their loop)."""
    return _lib.kernel(KERNELS[dtype])


def update(state: ctypes.Array, dtype: torch.dtype, address: int, count: int) -> None:
    """Feed `count` elements of `dtype` at `address` (the next ones of the tensor) into `state`;
    every piece but a tensor's last must be a multiple of BLOCK elements (module doc)."""
    _lib.kernel(KERNELS[dtype])(address, count, state)


def result(state: ctypes.Array) -> tuple[float, float]:
    """(absmax, sum) of the elements fed so far."""
    return state[LANES], state[LANES + 1]


def absmax_sum(tensor: torch.Tensor) -> tuple[float, float]:
    """(absmax, sum) of a plain contiguous CPU tensor whose dtype is in DTYPES (module doc)."""
    if tensor.dtype not in KERNELS:
        raise TypeError(f"absmax_sum: no kernel for {tensor.dtype}; it takes {', '.join(map(str, KERNELS))}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("absmax_sum: expects a contiguous CPU tensor")
    state = new_state()
    if tensor.numel():
        update(state, tensor.dtype, tensor.data_ptr(), tensor.numel())
    return result(state)
