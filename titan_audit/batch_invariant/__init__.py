"""batch_invariant/: ops whose per-row bits do not depend on the batch, and a mode that installs them
in place of the aten ops (guarantee G2).

Functional API: `matmul`, `mm`, `addmm`, `bmm`, `linear`, `sum`, `mean`, `softmax`, `log_softmax`,
`rms_norm`, `scaled_rms_norm` (the weight applied after the norm, as HF's RMSNorm: one kernel each
way on CPU, the bits of the two ops), `attention`; for inference (forward only) `add_rms_norm` (a
residual add and the norm after it), `rms_norm_rope` (q/k-norm then RoPE) and `silu_mul` (SwiGLU's
product), fused on CPU with the same bits. Mode: `enabled()` (context manager), `enable()`,
`disable()`, `is_enabled()` (read by the numerics fingerprint; it reports the overrides actually
installed). Gemm order (`order.py`, process-wide, v2 by default): `gemm_order("v1"|"v2")` (context
manager), `set_gemm_order`, `current_gemm_order()`; config key `determinism.bi_kernels`. `census`:
what else computed on a CPU tensor while the mode was on (record or strict; census.py), so "only
our kernels and exact IEEE ops run" is checked, not assumed. Kernels come from a backend chosen by
device (`backend.backend_for`): on CPU our own compiled kernels (`cpu/kernels`, built by `make`;
scalar, AVX2 and AVX-512 variants with identical bits, so BI results are the same on every CPU);
on CUDA the Triton kernels (`gpu/`: persistent matmul with fixed tiles and no split-K, row ops,
split-KV attention over a paged KV cache, deterministic attention backward), imported only when a
CUDA tensor arrives."""

from titan_audit.batch_invariant import census
from titan_audit.batch_invariant.attention import attention
from titan_audit.batch_invariant.backend import backend_for, register_backend
from titan_audit.batch_invariant.fused import add_rms_norm, rms_norm_rope, scaled_rms_norm, silu_mul
from titan_audit.batch_invariant.mode import disable, enable, enabled, is_enabled
from titan_audit.batch_invariant.ops import addmm, bmm, linear, log_softmax, matmul, mean, mm, rms_norm, softmax, sum
from titan_audit.batch_invariant.order import GEMM_ORDERS, current_gemm_order, gemm_order, set_gemm_order

__all__ = [
    "GEMM_ORDERS",
    "add_rms_norm",
    "addmm",
    "attention",
    "backend_for",
    "bmm",
    "census",
    "current_gemm_order",
    "disable",
    "enable",
    "enabled",
    "gemm_order",
    "is_enabled",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "mm",
    "register_backend",
    "rms_norm",
    "rms_norm_rope",
    "scaled_rms_norm",
    "set_gemm_order",
    "silu_mul",
    "softmax",
    "sum",
]
