"""Backend selection by device: the one place that maps a tensor's device to kernels.

Guarantee: an op on a device without a batch-invariant backend raises `NotImplementedError`;
it never falls back to a native (batch-variant) kernel. CPU -> `batch_invariant.cpu` (our
compiled kernels). CUDA -> `batch_invariant.gpu` (Triton kernels), imported on the first CUDA
tensor (so Triton is never imported on the CPU path); without Triton a CUDA op raises an error
that says so. `forced("triton")` (a context manager, for tests) sends CPU tensors to the Triton
kernels run by Triton's interpreter, within its block only; CPU users get the CPU backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Protocol

import torch


class Backend(Protocol):
    """The kernels a backend provides; all forward-only, below autograd, float32 compute."""

    NAME: str
    KEY_CHUNK: int
    FLOAT64_POINTWISE: tuple[str, ...]  # the element-wise functions that also take float64

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...
    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor: ...
    def sum_dims(self, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor: ...
    def tree_sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def softmax(self, x: torch.Tensor) -> torch.Tensor: ...
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...
    def softmax_backward(self, grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def log_softmax_backward(self, grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def rms_norm(self, x, weight, eps): ...  # noqa: ANN001, ANN201
    def rms_norm_backward(self, grad, x, weight, rstd): ...  # noqa: ANN001, ANN201
    def attention_forward(self, q, k, v, scale, causal, q_positions, doc_ids, extra_mask=None): ...  # noqa: ANN001, ANN201, E501
    # forward only, over a paged KV cache: the bits of attention_forward over the same keys gathered
    def paged_attention(
        self, q, k_cache, v_cache, block_table, seq_lens, q_positions, scale, *, causal=True, max_seq_len=None
    ): ...  # noqa: ANN001, ANN201, E501
    def embedding_backward(
        self, grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1
    ) -> torch.Tensor: ...
    # element-wise, float32 compute (the CPU backend also takes float64 for exp, log, sqrt)
    def exp(self, x: torch.Tensor) -> torch.Tensor: ...
    def exp2(self, x: torch.Tensor) -> torch.Tensor: ...
    def log(self, x: torch.Tensor) -> torch.Tensor: ...
    def sqrt(self, x: torch.Tensor) -> torch.Tensor: ...
    def sigmoid(self, x: torch.Tensor) -> torch.Tensor: ...
    def silu(self, x: torch.Tensor) -> torch.Tensor: ...
    def sigmoid_backward(self, grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def silu_backward(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...
    def attention_backward(self, grad_out, q, k, v, out, lse, scale, causal, q_positions, doc_ids, extra_mask=None): ...  # noqa: ANN001, ANN201, E501


_BACKENDS: dict[str, ModuleType] = {}
_FORCED: list[ModuleType] = []  # the innermost `forced` block's backend, if any


def _triton_backend() -> ModuleType:
    try:
        from titan_audit.batch_invariant import gpu
    except ImportError as exc:
        raise NotImplementedError(
            f"batch_invariant: the CUDA backend needs Triton ({exc}); install triton "
            "(pip install 'triton>=3.2'), refusing to fall back to native CUDA ops, which are not batch-invariant"
        ) from None
    return gpu


@contextlib.contextmanager
def forced(name: str) -> Iterator[ModuleType]:
    """Within the block every op uses backend `name` ("triton" or "cpu") whatever the device:
    "triton" on CPU tensors runs the Triton kernels in Triton's interpreter (tests)."""
    if name == "triton":
        module = _triton_backend()
    elif name == "cpu":
        from titan_audit.batch_invariant import cpu as module
    else:
        raise ValueError(f"batch_invariant: unknown backend {name!r} (cpu, triton)")
    _FORCED.append(module)
    try:
        yield module
    finally:
        _FORCED.pop()


def register_backend(device_type: str, module: ModuleType) -> None:
    """Make `module` (providing the `Backend` names) the kernels for tensors on `device_type`."""
    _BACKENDS[device_type] = module


def backend_for(*tensors: torch.Tensor | None) -> Backend:
    """The backend for the device of `tensors` (all on one device type)."""
    if _FORCED:
        return _FORCED[-1]  # type: ignore[return-value]
    cpu = _BACKENDS.get("cpu")
    if cpu is not None and all(t is None or t.device.type == "cpu" for t in tensors):
        return cpu  # type: ignore[return-value]  # the hot path: one dict lookup
    types = {t.device.type for t in tensors if t is not None}
    if len(types) != 1:
        raise ValueError(f"batch_invariant: tensors must be on one device type, got {sorted(types)}")
    device_type = types.pop()
    if device_type not in _BACKENDS and device_type == "cpu":
        from titan_audit.batch_invariant import cpu

        register_backend("cpu", cpu)
    if device_type not in _BACKENDS and device_type == "cuda":
        register_backend("cuda", _triton_backend())
    if device_type not in _BACKENDS:
        raise NotImplementedError(f"batch_invariant: no backend for device type {device_type!r}")
    return _BACKENDS[device_type]  # type: ignore[return-value]
