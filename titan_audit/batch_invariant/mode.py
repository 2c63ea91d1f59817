"""The override mode: aten ops replaced, per device, by the batch-invariant kernels (torch.library).

While the mode is on, unmodified code (`torch.nn.functional`, `nn.Module`s, `x @ w`) runs the
batch-invariant kernels for: `mm`, `addmm`, `bmm` (so `matmul` and `linear`, which decompose
into them), `_softmax`, `_log_softmax` and their backward ops, `sum` (all elements), `sum.dim_IntList`,
`mean.dim`, `linalg_vector_norm` (ord 1, 2; +-inf native, order-free),
`rms_norm` (a CompositeImplicitAutograd op in torch 2.13: overridden at that key by the
functional op, which brings its own deterministic autograd; on a CUDA tensor it reaches the
backend check like every op), and `scaled_dot_product_attention` (through its CPU kernel
`_scaled_dot_product_flash_attention_for_cpu` and its backward; on CUDA through the flash,
memory-efficient and cuDNN kernels and their backward, `CUDA_OVERRIDES`), `mean` (all elements),
`embedding_dense_backward` (fixed order, CPU and CUDA) and on CPU the elementwise ops whose native
kernels the CPU vendor's library picks (`elementwise.py`: exp, log, sqrt, rsqrt, pow, sigmoid,
silu, add/sub with alpha). Every other aten op with a CPU kernel that is not exact by IEEE gets a
census guard (`census.py`): counted or, under `census.strict()`, refused. The device-key
overrides sit below autograd, so autograd's backward formulas call the overridden ops too.
The overridden mm / addmm / bmm call the backend's `mm` / `bmm`, as the functional ops do, so
they sum in the same process-wide gemm order (`order.py`: v2 by default, `enabled(gemm_order=)`).

State guarantee: the overrides are installed iff the mode is on, and `is_enabled()` reads the
installed state itself (no separate flag that could disagree). `enabled()` restores the state
it found on exit, also on an exception, so an inner block's exit never drops the overrides of an
outer block (the bug of the public library, whose context manager disables unconditionally).
`enable()` and `disable()` are idempotent switches. The kernels never re-enter the mode: they
are our own compiled kernels, called through ctypes, and call no aten op the mode overrides.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from titan_audit.batch_invariant import census, elementwise, order
from titan_audit.batch_invariant.backend import backend_for

_LOCK = threading.RLock()
_LIBRARIES: list[torch.library.Library] = []
_ROUTES: dict[str, Callable[..., Any]] = {}  # elementwise.routes(), made on the first enable()
DEVICE_KEYS = ("CPU", "CUDA")  # every overridden op reaches backend_for: CUDA -> the Triton kernels
# (or an error without Triton), never a silent fallback to native (variant) CUDA kernels.


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _mm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return backend_for(self, mat2).mm(self, mat2)


def _bmm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return backend_for(self, mat2).bmm(self, mat2)


def _addmm(
    self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    out = backend_for(mat1, mat2).mm(mat1, mat2)
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        out = out + (self if beta == 1 else self * beta)
    return _cast(out, mat1.dtype)


def _softmax_impl(log: bool) -> Callable[..., torch.Tensor]:
    def impl(self: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        dim = dim % max(self.dim(), 1)
        be = backend_for(self)
        x = self.movedim(dim, -1) if self.dim() else self.reshape(1)
        y = be.log_softmax(x) if log else be.softmax(x)
        dtype = torch.float32 if half_to_float else self.dtype
        return _cast(y, dtype).movedim(-1, dim).reshape(self.shape).contiguous()

    return impl


def _softmax_backward_impl(log: bool) -> Callable[..., torch.Tensor]:
    def impl(grad_output: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
        dim = dim % max(output.dim(), 1)
        be = backend_for(output)
        g = grad_output.movedim(dim, -1).float() if grad_output.dtype != torch.float64 else grad_output.movedim(dim, -1)
        y = output.movedim(dim, -1).to(g.dtype)
        out = be.log_softmax_backward(g, y) if log else be.softmax_backward(g, y)
        return _cast(out, input_dtype).movedim(-1, dim).contiguous()

    return impl


def _dims(self: torch.Tensor, dim: list[int] | None) -> list[int]:
    if dim is None or len(dim) == 0:
        return list(range(self.dim()))
    return sorted({d % max(self.dim(), 1) for d in dim})


def _sum_impl(mean: bool) -> Callable[..., torch.Tensor]:
    native = torch.ops.aten.mean.out if mean else torch.ops.aten.sum.IntList_out

    def impl(
        self: torch.Tensor, dim: list[int] | None = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        x = self if dtype is None else self.to(dtype)
        if x.is_floating_point() and self.dim() == 0:
            return x.clone()  # a sum or mean of one element is that element, exactly
        if not x.is_floating_point():
            # Integer and bool sums are exact (associative), so any order gives the same bits.
            out = torch.empty(0, dtype=dtype or (torch.int64 if not x.is_floating_point() else x.dtype))
            return native(x, dim, keepdim, dtype=dtype, out=out)
        dims = _dims(x, dim)
        out = backend_for(x).sum_dims(x, dims, keepdim)
        if mean:
            count = 1
            for d in dims:
                count *= x.shape[d]
            out = out / count
        return _cast(out, x.dtype)

    return impl


def _sum_all(self: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten::sum (no dim, e.g. `loss.sum()`): every element by the fixed-tree sum."""
    return _sum_impl(mean=False)(self, None, False, dtype=dtype)


def _mean_all(self: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten::mean (no dim, e.g. `rewards.mean()`): the fixed-tree sum over the element count."""
    return _sum_impl(mean=True)(self, None, False, dtype=dtype)


def _vector_norm(
    self: torch.Tensor,
    ord: Any = 2,
    dim: list[int] | None = None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """aten::linalg_vector_norm for ord 2 (sqrt of the fixed-tree sum of squares: x * x and sqrt
    are correctly rounded everywhere) and ord 1; max/min norms are order-free and run natively."""
    x = self if dtype is None else self.to(dtype)
    if ord in (float("inf"), float("-inf")):
        out = torch.empty(0, dtype=x.dtype, device=x.device)
        return torch.ops.aten.linalg_vector_norm.out(x, ord, dim, keepdim, dtype=None, out=out)
    if ord not in (1, 2):
        raise NotImplementedError(f"batch_invariant: linalg.vector_norm with ord={ord!r} (only 1, 2 and +-inf)")
    be = backend_for(x)
    if ord == 2 and x.dtype in (torch.float32, torch.float64) and hasattr(be, "sum_squares_dims"):
        # the bits of the sum of x * x below, without the temporary (a gradient norm: 16+ MB)
        total = _cast(be.sum_squares_dims(x, _dims(x, dim), keepdim), x.dtype)
        return total.sqrt()
    terms = x.abs() if ord == 1 else x * x
    total = _sum_impl(mean=False)(terms, dim, keepdim)
    return total if ord == 1 else total.sqrt()


def _sdpa_mask(attn_mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """SDPA's attn_mask as a bool 'may attend' mask [B|1, H|1, Tq, Tk]; additive masks must be 0/-inf."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        finite = attn_mask == 0
        if not bool((finite | (attn_mask == float("-inf"))).all()):
            raise NotImplementedError(
                "batch_invariant: SDPA with an additive float attn_mask other than 0/-inf is not supported"
            )
        attn_mask = finite
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask.expand(attn_mask.shape[0], attn_mask.shape[1], q.shape[2], k.shape[2])


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if dropout_p != 0.0:
        raise NotImplementedError("batch_invariant: scaled_dot_product_attention with dropout is not supported")
    batch, _, tq, dim = query.shape
    positions = torch.arange(tq, device=query.device).expand(batch, tq)  # SDPA's causal mask is top-left aligned
    scale = dim**-0.5 if scale is None else scale
    out, lse = backend_for(query, key, value).attention_forward(
        query, key, value, scale, is_causal, positions, None, _sdpa_mask(attn_mask, query, key)
    )
    return _cast(out, query.dtype), lse


def _sdpa_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, _, tq, dim = query.shape
    positions = torch.arange(tq, device=query.device).expand(batch, tq)
    scale = dim**-0.5 if scale is None else scale
    dq, dk, dv = backend_for(query, key, value).attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        scale,
        is_causal,
        positions,
        None,
        _sdpa_mask(attn_mask, query, key),
    )
    return _cast(dq, query.dtype), _cast(dk, key.dtype), _cast(dv, value.dtype)


def _rms_norm(
    input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """aten::rms_norm (CompositeImplicitAutograd): the functional op, with its own autograd."""
    from titan_audit.batch_invariant import ops  # ops imports nothing from here; late to keep layers clear

    n = len(normalized_shape)
    if tuple(input.shape[input.dim() - n :]) != tuple(normalized_shape):
        raise ValueError(
            f"rms_norm: normalized_shape {list(normalized_shape)} does not match input {tuple(input.shape)}"
        )
    flat = input.reshape(*input.shape[: input.dim() - n], -1)
    w = None if weight is None else weight.reshape(-1)
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    return ops.rms_norm(flat, w, eps).reshape(input.shape)


# Ops with a composite (above-autograd) kernel: overridden at that key, with autograd of our own.
COMPOSITE_OVERRIDES: dict[str, Callable[..., Any]] = {
    "rms_norm": _rms_norm,
}


def _no_tensor(like: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _cuda_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    """CUDA flash SDPA: our attention; the varlen / RNG outputs are empty (no dropout)."""
    out, lse = _sdpa(query, key, value, dropout_p, is_causal, scale=scale)
    e = _no_tensor(query)
    return out, lse, e, e, query.shape[2], key.shape[2], e, e, _no_tensor(query, query.dtype)


def _cuda_flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: Any,
    cum_seq_k: Any,
    max_q: Any,
    max_k: Any,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Any,
    philox_offset: Any,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)


def _cuda_efficient(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """CUDA memory-efficient SDPA (float32, masks): our attention, attn_bias as a 0/-inf mask."""
    out, lse = _sdpa(query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    return out, lse, _no_tensor(query), _no_tensor(query)


def _cuda_efficient_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    philox_seed: Any,
    philox_offset: Any,
    dropout_p: float,
    grad_input_mask: list[bool],
    is_causal: bool = False,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    if attn_bias is not None and attn_bias.numel() and len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise NotImplementedError("batch_invariant: a gradient for SDPA's attn_mask is not supported")
    dq, dk, dv = _sdpa_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        dropout_p,
        is_causal,
        attn_mask=attn_bias if attn_bias is not None and attn_bias.numel() else None,
        scale=scale,
    )
    return dq, dk, dv, _no_tensor(query, query.dtype)


def _cuda_cudnn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: float | None = None,
) -> tuple[Any, ...]:
    out, lse = _sdpa(query, key, value, dropout_p, is_causal, attn_mask=attn_bias, scale=scale)
    e = _no_tensor(query)
    return out, lse, e, e, query.shape[2], key.shape[2], e, e, _no_tensor(query, query.dtype)


def _cuda_cudnn_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    philox_seed: Any,
    philox_offset: Any,
    attn_bias: torch.Tensor | None,
    cum_seq_q: Any,
    cum_seq_k: Any,
    max_q: Any,
    max_k: Any,
    dropout_p: float,
    is_causal: bool,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _sdpa_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        dropout_p,
        is_causal,
        attn_mask=attn_bias if attn_bias is not None and attn_bias.numel() else None,
        scale=scale,
    )


# CUDA's SDPA kernels (the CPU one is overridden in OVERRIDES), each with its backward, so that
# autograd's formula for the forward we replaced calls our backward with our saved outputs.
CUDA_OVERRIDES: dict[str, Callable[..., Any]] = {
    "_scaled_dot_product_flash_attention": _cuda_flash,
    "_scaled_dot_product_flash_attention_backward": _cuda_flash_backward,
    "_scaled_dot_product_efficient_attention": _cuda_efficient,
    "_scaled_dot_product_efficient_attention_backward": _cuda_efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cuda_cudnn,
    "_scaled_dot_product_cudnn_attention_backward": _cuda_cudnn_backward,
}
CUDA_ONLY_OPS = tuple(CUDA_OVERRIDES)


OVERRIDES: dict[str, Callable[..., Any]] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "_softmax": _softmax_impl(log=False),
    "_log_softmax": _softmax_impl(log=True),
    "_softmax_backward_data": _softmax_backward_impl(log=False),
    "_log_softmax_backward_data": _softmax_backward_impl(log=True),
    "sum.dim_IntList": _sum_impl(mean=False),
    "mean.dim": _sum_impl(mean=True),
    "sum": _sum_all,
    "mean": _mean_all,
    "linalg_vector_norm": _vector_norm,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward,
}


def _embedding_backward(
    keyset: Any, grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """aten::embedding_dense_backward: each row's gradient added in ascending token order on the
    backend's kernel (ATen's goes through index_put_ with accumulate, in an order of its iterator's
    choosing). The cases it does not cover run ATen's CPU kernel, counted by the census; on any
    other device they are refused (no native CUDA fallback)."""
    if scale_grad_by_freq or not grad.is_floating_point() or grad.dtype == torch.float64:
        op = "aten::embedding_dense_backward"
        reason = "scale_grad_by_freq" if scale_grad_by_freq else f"dtype {grad.dtype}"
        if grad.device.type != "cpu":
            raise NotImplementedError(f"batch_invariant: {op} with {reason} on {grad.device.type}")
        census.note(op, reason)
        return census.original(op)(keyset, grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    out = backend_for(grad, indices).embedding_backward(grad, indices, num_weights, padding_idx)
    return _cast(out, grad.dtype)


# Overrides that take the dispatch keyset (to call the native CPU kernel where they defer),
# registered at every key of DEVICE_KEYS: CPU with the elementwise routes, CUDA beside CUDA_OVERRIDES.
KEYSET_OVERRIDES: dict[str, Callable[..., Any]] = {
    "embedding_dense_backward": _embedding_backward,
}


def is_enabled() -> bool:
    """True while the batch-invariant overrides are installed in this process."""
    return bool(_LIBRARIES)


def enable() -> None:
    """Install the overrides, the CPU elementwise routes and the census guards (no-op when on)."""
    with _LOCK:
        if _LIBRARIES:
            return
        if not _ROUTES:
            _ROUTES.update(elementwise.routes())
            _ROUTES.update(KEYSET_OVERRIDES)
        routes = _ROUTES
        census.prefetch([f"aten::{name}" for name in routes])  # their native kernels, before ours shadow them
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # overriding the native kernel is the point
                warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
                for key in DEVICE_KEYS:
                    for name, fn in OVERRIDES.items():
                        library.impl(name, fn, key)
                for name, fn in CUDA_OVERRIDES.items():
                    library.impl(name, fn, "CUDA")
                for name, fn in KEYSET_OVERRIDES.items():
                    library.impl(name, fn, "CUDA", with_keyset=True)
                for name, fn in COMPOSITE_OVERRIDES.items():
                    library.impl(name, fn, "CompositeImplicitAutograd")
                for name, fn in routes.items():
                    library.impl(name, fn, "CPU", with_keyset=True)
                census.install(library, set(OVERRIDES) | set(routes))
        except BaseException:
            library._destroy()
            raise
        _LIBRARIES.append(library)


def disable() -> None:
    """Remove the overrides (no-op when already off)."""
    with _LOCK:
        while _LIBRARIES:
            _LIBRARIES.pop()._destroy()


@contextlib.contextmanager
def enabled(on: bool = True, *, gemm_order: str | None = None) -> Iterator[None]:
    """Turn the mode on (or off, with on=False) for the block; restore the previous state after.
    gemm_order ("v1" | "v2"): the gemm order for the block too (`order.gemm_order`); None keeps the
    process's order (v2 unless a run or an outer block set v1)."""
    with contextlib.ExitStack() as stack:
        if gemm_order is not None:
            stack.enter_context(order.gemm_order(gemm_order))
        with _LOCK:
            was_on = is_enabled()
            enable() if on else disable()
        try:
            yield
        finally:
            with _LOCK:
                enable() if was_on else disable()
