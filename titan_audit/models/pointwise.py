"""Position-independent `exp`, `sigmoid` and `silu`: an element's bits depend on its value only.

Why this exists: on CPU, PyTorch's transcendental elementwise kernels run a SIMD approximation
(Sleef) over the body of a tensor and the scalar libm function over the tail that does not fill a
vector. The two can differ in the last bit, so `F.silu(x)[i]` depends on where element `i` sits in
the flattened tensor, i.e. on the batch size and on the other rows. Measured on this project's
AVX512 CPU: fp32 `F.silu` over row prefixes of one matrix differs in ~1 element of 1000.

These versions use only IEEE operations that are correctly rounded on every backend and in both
vector and scalar paths (add, sub, mul, div, round, clamp, integer shifts), each as its own kernel,
so an element's result is a function of its value alone. `exp` is Cephes-style: n = round(x/ln2),
r = x - n*ln2 (ln2 split in two for an exact product), a degree-6 polynomial for e^r, and 2^n
built from the exponent bits. Accuracy is about 2 ulp in float32, on [-87, 88] (inputs are
clamped there: below, e^x underflows to ~1e-38; above, it would overflow).

The model uses these in batch-invariant mode only; outside it, the native (faster) kernels run.
Inputs of other floating dtypes are computed in float32 and cast back.
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # float32 with the low 12 mantissa bits zero: n * _LN2_HI is exact
_LN2_LO = 1.428606765330187e-06
_EXP_MIN, _EXP_MAX = -87.0, 88.0
# Cephes expf coefficients for e^r - 1 - r on |r| <= ln2 / 2, highest degree first.
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x, same bits for the same input element wherever it sits; differentiable."""
    dtype = x.dtype
    x = x.float().clamp(_EXP_MIN, _EXP_MAX)
    n = torch.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    poly = torch.full_like(r, _POLY[0])
    for coefficient in _POLY[1:]:
        poly = poly * r + coefficient
    e_r = (poly * (r * r) + r) + 1.0
    two_n = torch.bitwise_left_shift(n.detach().to(torch.int32) + 127, 23).view(torch.float32)
    return (e_r * two_n).to(dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), position independent (see module doc)."""
    dtype = x.dtype
    return (1.0 / (1.0 + exp(-x.float()))).to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), position independent (see module doc)."""
    dtype = x.dtype
    x32 = x.float()
    return (x32 * sigmoid(x32)).to(dtype)
