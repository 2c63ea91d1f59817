"""The CPU backend: batch-invariant kernels of our own, compiled from `cpu/kernels/*.cpp` into one
library with scalar / AVX2 / AVX-512 variants that give identical bits (`_lib`): gemm
(`matmul.py`; `mm` / `bmm` here sum in the process-wide gemm order, `batch_invariant.order`),
attention (`attention.py`), the embedding's weight gradient (`embedding.py`), the row reductions
and fused row ops (`reductions.py`) and the element-wise functions (`pointwise.py`; `exp`, `log`,
`sqrt`, `sigmoid`, `silu`, ... here, as the backend provides them to the model and to the mode).
Fused ops exist on this backend alone, outside the `Backend` protocol (a GPU backend need not
have them; `batch_invariant.fused` composes the separate ops where one is missing): for inference
`add_rms_norm` (a residual add and the norm after it) and `rms_norm_rope` (q/k-norm then RoPE);
`silu_mul` (SwiGLU's silu(gate) * up) with `silu_mul_backward`, `rms_norm_scaled_backward` (the
backward of the weight applied after the norm) and `sum_squares_dims` (a vector norm's sum of
squares without the temporary). Every kernel here is forward-only and works below autograd;
`titan_audit.batch_invariant.ops` and `.fused` add autograd and input checks on top.

The backend interface (what a GPU backend must provide, by these names and signatures) is the
`Backend` protocol in `titan_audit.batch_invariant.backend`. `kernel_library` is the loader of the
compiled library (which variants this CPU has, the forced variant of the cross-variant tests, its
version); `KernelLibraryError` is what a missing, stale or foreign build raises.
"""

from titan_audit.batch_invariant.cpu import _lib as kernel_library
from titan_audit.batch_invariant.cpu import pointwise
from titan_audit.batch_invariant.cpu.attention import KEY_CHUNK, attention_backward, attention_forward, paged_attention
from titan_audit.batch_invariant.cpu.embedding import embedding_backward
from titan_audit.batch_invariant.cpu.matmul import backend_bmm as bmm
from titan_audit.batch_invariant.cpu.matmul import backend_mm as mm
from titan_audit.batch_invariant.cpu.pointwise import (
    exp,
    exp2,
    log,
    sigmoid,
    sigmoid_backward,
    silu,
    silu_backward,
    silu_mul,
    silu_mul_backward,
    sqrt,
)
from titan_audit.batch_invariant.cpu.reductions import (
    add_rms_norm,
    log_softmax,
    log_softmax_backward,
    rms_norm,
    rms_norm_backward,
    rms_norm_rope,
    rms_norm_scaled_backward,
    softmax,
    softmax_backward,
    sum_dims,
    sum_squares_dims,
    tree_sum,
)

NAME = "cpu"
FLOAT64_POINTWISE = pointwise.FLOAT64  # exp, log, sqrt have float64 kernels
KernelLibraryError = kernel_library.KernelLibraryError  # a missing, stale or foreign kernel build

__all__ = [
    "FLOAT64_POINTWISE",
    "KEY_CHUNK",
    "NAME",
    "KernelLibraryError",
    "add_rms_norm",
    "attention_backward",
    "attention_forward",
    "bmm",
    "embedding_backward",
    "exp",
    "exp2",
    "log",
    "kernel_library",
    "log_softmax",
    "log_softmax_backward",
    "mm",
    "paged_attention",
    "pointwise",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_rope",
    "rms_norm_scaled_backward",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "silu_mul",
    "silu_mul_backward",
    "softmax",
    "softmax_backward",
    "sqrt",
    "sum_dims",
    "sum_squares_dims",
    "tree_sum",
]
