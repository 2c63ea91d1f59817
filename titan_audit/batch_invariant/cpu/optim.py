"""The fused AdamW update of one float32 parameter on our compiled kernel (`kernels/optim.cpp`),
for `trainer.optim.PortableAdamW`.

Guarantee: `adamw_step_` writes into `param`, `exp_avg` and `exp_avg_sq` the bits that
PortableAdamW's torch-op path writes (each torch op with a Python scalar rounds the scalar to
float32 first; `add_` with alpha 1 is a plain add), element by element in one pass over memory,
the same on every CPU, ISA variant and thread count (the sequence is in kernels/optim.cpp;
tests/trainer/test_portable_adamw_kernel.py compares raw bits with the torch path). NaN payloads
are pinned only for inputs without NaN (see the kernel). It takes only what the kernel can do
in place: float32, contiguous, CPU, one shape, four distinct buffers; `fusable` says whether a
set of tensors qualifies (anything else stays on the torch path).
"""

from __future__ import annotations

import ctypes

import torch

from titan_audit.batch_invariant.cpu import _lib

PARALLEL_MIN_ELEMENTS = 1 << 16  # below this one thread does the call (threads never change bits)

_lib.declare(
    "adamw_step_f32",
    None,
    [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_double] * 8 + [ctypes.c_int],
)


def fusable(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether the kernel can update these plain tensors in place (else: the torch path)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors):
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return False
    if any(t.shape != param.shape for t in tensors):
        return False
    if param.numel() == 0:
        return True
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in tensors)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    bias_correction2_sqrt: float,
    step_size: float,
) -> None:
    """One AdamW step in place (module doc): decay = 1 - lr*wd, bias_correction2_sqrt =
    sqrt(1 - beta2^t), step_size = -lr / (1 - beta1^t), all Python floats (rounded to float32 by
    the kernel, as torch rounds them). ValueError for tensors `fusable` refuses."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not fusable(*tensors):
        got = [(t.dtype, t.device.type, tuple(t.shape), t.is_contiguous()) for t in tensors]
        raise ValueError(
            "adamw_step_: param, grad, exp_avg, exp_avg_sq must be distinct contiguous float32 CPU tensors "
            f"of one shape, got {got}"
        )
    n = param.numel()
    if n == 0:
        return
    _lib.kernel("adamw_step_f32")(
        _lib.ptr(param),
        _lib.ptr(grad),
        _lib.ptr(exp_avg),
        _lib.ptr(exp_avg_sq),
        n,
        decay,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2_sqrt,
        eps,
        step_size,
        _lib.num_threads() if n >= PARALLEL_MIN_ELEMENTS else 1,
    )
    for t in (param, exp_avg, exp_avg_sq):  # written in place, as torch's in-place ops would say
        torch.autograd.graph.increment_version(t)
