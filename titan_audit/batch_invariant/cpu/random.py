"""Normal samples from given random bits, the same bits on every CPU (kernels/random.cpp).

`normal_from_bits(bits, mean, std)`: float32 samples, two per pair of uint32 words, by
Box-Muller on our own log/cos/sin polynomials. The bits come from the caller (e.g. numpy's
Philox, integer arithmetic only), so the samples depend on (bits, mean, std) alone: not on the
ISA, ATEN_CPU_CAPABILITY, the thread count or the CPU. Used for weight init (models/init.py),
where torch's `normal_` would tie the weights to the ISA ATen dispatches to.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from titan_audit.batch_invariant.cpu import _lib

_lib.declare(
    "normal_from_bits", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float]
)


def normal_from_bits(bits: np.ndarray, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """len(bits) float32 samples ~ N(mean, std^2) from an even number of uint32 words."""
    if bits.dtype != np.uint32 or bits.ndim != 1 or bits.size % 2:
        raise ValueError(
            f"normal_from_bits: bits must be a 1-D uint32 array of even length, got {bits.dtype} {bits.shape}"
        )
    bits = np.ascontiguousarray(bits)
    out = _lib.output((bits.size,), torch.float32)
    _lib.kernel("normal_from_bits")(bits.ctypes.data, out.data_ptr(), bits.size // 2, float(mean), float(std))
    return out
