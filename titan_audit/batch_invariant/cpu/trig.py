"""cos and sin of float32 angles on our own kernel (kernels/trig.cpp), the same bits on every CPU.

`rope_inv_freq(theta, head_dim)`: the RoPE frequencies by our float64 exp/log (torch.pow's
bits follow ATEN_CPU_CAPABILITY). `cos_sin(angles)` -> (cos, sin), float32, each element a function
of its angle alone: float64 range reduction and Taylor polynomials, rounded once (within 1 ulp for
|angle| < 2^16). Used for the RoPE tables (models/rope.py): torch.cos/sin give a large table other
bits under ATEN_CPU_CAPABILITY=default or MKL_CBWR=COMPATIBLE, so the rotation would depend on the
CPU.
"""

from __future__ import annotations

import ctypes

import torch

from titan_audit.batch_invariant.cpu import _lib

_lib.declare("cos_sin_f32", None, [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int])
_lib.declare("rope_inv_freq_f32", None, [ctypes.c_double, ctypes.c_int64, ctypes.c_void_p])


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2]: 1 / theta^(2i / head_dim), by our float64 exp/log, rounded once."""
    if not theta > 0 or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_inv_freq: need theta > 0 and an even head_dim >= 2, got {theta}, {head_dim}")
    out = _lib.output((head_dim // 2,), torch.float32)
    _lib.kernel("rope_inv_freq_f32")(float(theta), int(head_dim), _lib.ptr(out))
    return out


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a float32 CPU tensor of angles in radians, element by element."""
    if not isinstance(angles, torch.Tensor) or angles.dtype != torch.float32 or angles.device.type != "cpu":
        raise ValueError(
            f"cos_sin: expected a float32 CPU tensor, got {getattr(angles, 'dtype', type(angles).__name__)}"
        )
    angles = angles.contiguous()
    cos, sin = _lib.output(angles.shape, angles.dtype), _lib.output(angles.shape, angles.dtype)
    if angles.numel():
        threads = _lib.num_threads() if angles.numel() >= 1 << 16 else 1
        _lib.kernel("cos_sin_f32")(_lib.ptr(angles), _lib.ptr(cos), _lib.ptr(sin), angles.numel(), threads)
    return cos, sin
