"""How far apart two tensors of the same dtype and shape are: differing elements, max abs diff, ULPs.

Guarantees:
- `differing_elements` counts elements whose raw bits differ (so -0.0 vs +0.0 and different NaN
  payloads count); it is 0 iff the tensors are bitwise equal.
- `max_abs_diff` is max |a - b| computed in float64 over the elements (NaN when any compared
  pair involves a NaN that is not bit-identical in both; inf when an inf meets a finite value).
- `max_ulp` (floating dtypes only) is the largest distance between the two values in units in
  the last place of their own format: the number of representable values between them, counted
  on the monotone integer ordering of the format's bit patterns (computed on unsigned 64-bit
  integers, so no overflow even for float64). +0.0 and -0.0 are 0 ULP apart (but still count as
  differing elements). For integer dtypes it is None (max_abs_diff is the distance).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from titan_audit.audit.bitwise import bits


@dataclass(frozen=True)
class TensorDiff:
    numel: int
    differing_elements: int
    max_abs_diff: float
    max_ulp: int | None
    first_index: list[int] | None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if isinstance(out["max_abs_diff"], float) and not math.isfinite(out["max_abs_diff"]):
            out["max_abs_diff"] = str(out["max_abs_diff"])  # JSON has no nan/inf
        return out


def _ordered_u64(raw: np.ndarray, width_bits: int) -> np.ndarray:
    """Map IEEE sign-magnitude bit patterns to uint64 keys that increase with the float value."""
    if raw.dtype.kind == "u":  # 1-byte floats come as uint8: reinterpret as signed
        raw = raw.view(np.dtype(f"i{raw.dtype.itemsize}"))
    signed = raw.astype(np.int64)
    if width_bits < 64:
        low = np.int64(-(1 << (width_bits - 1)))
        key = np.where(signed < 0, low - signed, signed)  # -m for negatives, +m for positives
        return (key + np.int64(1 << 62)).astype(np.uint64)  # |key| < 2^31: shift positive
    low = np.int64(np.iinfo(np.int64).min)
    key = np.where(signed < 0, low - signed, signed)
    return key.view(np.uint64) ^ np.uint64(1 << 63)


def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Element-wise distance of two tensors with the same dtype and shape (ValueError otherwise)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"cannot diff tensors of dtype/shape {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    bits_a, bits_b = bits(a).reshape(-1), bits(b).reshape(-1)
    differ = bits_a != bits_b
    count = int(differ.sum())
    numel = a.numel()
    if count == 0:
        return TensorDiff(numel, 0, 0.0, 0 if a.is_floating_point() else None, None)
    flat_first = int(differ.nonzero()[0])
    first = [int(i) for i in torch.unravel_index(torch.tensor(flat_first), a.shape)] if a.dim() else []
    idx = differ.nonzero().reshape(-1)
    if a.is_complex():
        va, vb = torch.view_as_real(a).reshape(-1, 2)[idx].double(), torch.view_as_real(b).reshape(-1, 2)[idx].double()
        diff = (va - vb).abs().amax(dim=1)
    elif a.dtype is torch.bool:
        diff = (a.reshape(-1)[idx].double() - b.reshape(-1)[idx].double()).abs()
    else:
        va, vb = a.reshape(-1)[idx].double(), b.reshape(-1)[idx].double()
        both_same_nan = torch.isnan(va) & torch.isnan(vb)
        diff = torch.where(both_same_nan, torch.full_like(va, math.nan), (va - vb).abs())
    max_abs = float(diff.max()) if not torch.isnan(diff).any() else math.nan
    max_ulp = None
    if a.is_floating_point():
        width = a.element_size() * 8
        ka = _ordered_u64(bits_a[idx].numpy(), width)
        kb = _ordered_u64(bits_b[idx].numpy(), width)
        ulps = np.where(ka > kb, ka - kb, kb - ka)
        max_ulp = int(ulps.max())
    return TensorDiff(numel, count, max_abs, max_ulp, first)
