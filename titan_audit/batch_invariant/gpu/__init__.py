"""The Triton backend: batch-invariant kernels for CUDA tensors (and, in Triton's interpreter, for
CPU tensors when a test forces it with `batch_invariant.backend.forced("triton")`).

It provides the `Backend` protocol of `batch_invariant.backend` by the same names as the CPU
backend: `mm`, `bmm` (matmul.py: persistent, fixed tiles per dtype, no split-K), `sum_dims`,
`tree_sum` (sum.py), `softmax`, `log_softmax` and their backward (softmax.py), `rms_norm` and
its backward (rms_norm.py), `attention_forward` (attention.py: split-KV over a paged KV cache,
fixed split size, ascending combine; `paged_attention` is its paged entry point) and
`attention_backward` (attention_backward.py: no atomics) and `embedding_backward` (embedding.py:
the CPU kernel's order, one program per touched row and D block, no atomics) and the element-wise
`exp`, `exp2`, `log`, `sqrt`, `sigmoid`, `silu`, `sigmoid_backward`, `silu_backward` (pointwise.py:
the CPU kernels' sequences op for op, so the same bits). Why each kernel is batch-invariant is
written at the top of its file. Importing this package imports Triton; `batch_invariant.backend`
imports it only for a CUDA tensor or a forced Triton backend, so the CPU path never does.

The bits differ from the CPU backend's (another order of operations; `embedding_backward` and the
element-wise functions are the exceptions, in the CPU kernels' order): batch invariance holds
within a backend and a device kind, and the numerics fingerprint records both.
"""

from titan_audit.batch_invariant.gpu._runtime import TRITON_VERSION
from titan_audit.batch_invariant.gpu.attention import KEY_CHUNK, attention_forward, paged_attention
from titan_audit.batch_invariant.gpu.attention_backward import attention_backward
from titan_audit.batch_invariant.gpu.embedding import embedding_backward
from titan_audit.batch_invariant.gpu.matmul import bmm, mm
from titan_audit.batch_invariant.gpu.pointwise import (
    exp,
    exp2,
    log,
    sigmoid,
    sigmoid_backward,
    silu,
    silu_backward,
    sqrt,
)
from titan_audit.batch_invariant.gpu.rms_norm import rms_norm, rms_norm_backward
from titan_audit.batch_invariant.gpu.softmax import log_softmax, log_softmax_backward, softmax, softmax_backward
from titan_audit.batch_invariant.gpu.sum import sum_dims, tree_sum

NAME = "triton"
FLOAT64_POINTWISE: tuple[str, ...] = ()  # no float64 element-wise kernel on Triton

__all__ = [
    "FLOAT64_POINTWISE",
    "KEY_CHUNK",
    "NAME",
    "TRITON_VERSION",
    "attention_backward",
    "attention_forward",
    "bmm",
    "embedding_backward",
    "exp",
    "exp2",
    "log",
    "log_softmax",
    "log_softmax_backward",
    "mm",
    "paged_attention",
    "rms_norm",
    "rms_norm_backward",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "softmax",
    "softmax_backward",
    "sqrt",
    "sum_dims",
    "tree_sum",
]
