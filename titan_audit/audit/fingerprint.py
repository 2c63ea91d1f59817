"""Tensor fingerprints: xxh3-128 over a (dtype, shape) header and the tensor's raw bytes.

Guarantee: two tensors get the same fingerprint iff they have the same dtype, the same shape and
the same bytes in row-major order (up to xxh3-128 collisions). So -0.0 and +0.0 differ, NaN
payloads count, and equal bytes under another dtype or shape differ. Strides, storage offset,
device and autograd state do not count: the *logical* tensor is hashed.

Byte format (stable; changing it changes every golden file):
    header = b"titan-audit.tensor.v1|" + dtype name (e.g. b"bfloat16") + b"|" + shape as
             comma-separated decimal (b"" for a 0-d tensor) + b"|"
    digest = xxh3_128(header + row-major little-endian bytes of the tensor).hexdigest()

Every dtype is hashed through its bytes, never through a float conversion, so bfloat16, float8
and any dtype numpy lacks are exact. A contiguous CPU tensor is read in place (zero copy); other
tensors are made contiguous on the CPU first. A DTensor is hashed as its full logical tensor
(`full_tensor()`, a collective: every rank of its mesh must call `fingerprint` together), so the
hash does not depend on how it is sharded.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping

import torch
import xxhash

HEADER_PREFIX = b"titan-audit.tensor.v1|"

_header_cache: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}


def _header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    key = (dtype, shape)
    header = _header_cache.get(key)
    if header is None:
        name = str(dtype).removeprefix("torch.")
        header = b"%s%s|%s|" % (HEADER_PREFIX, name.encode(), ",".join(map(str, shape)).encode())
        if len(_header_cache) < 65536:
            _header_cache[key] = header
    return header


def _logical_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's logical value as a contiguous, plain, CPU tensor (no copy when it is one)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fingerprint expects a torch.Tensor, got {type(tensor).__name__}")
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        tensor = _unwrap_subclass(tensor)
    if tensor.layout is not torch.strided:
        raise ValueError(f"cannot fingerprint a tensor with layout {tensor.layout}; densify it first")
    if tensor.is_meta:
        raise ValueError("cannot fingerprint a meta tensor: it has no data")
    if tensor.is_quantized:
        raise ValueError("cannot fingerprint a quantized tensor; hash its int_repr() and scales instead")
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def _unwrap_subclass(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if isinstance(tensor, torch.nn.Parameter) or type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return tensor.as_subclass(torch.Tensor)
    raise ValueError(f"cannot fingerprint tensor subclass {type(tensor).__name__}")


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def fingerprint(tensor: torch.Tensor) -> str:
    """xxh3-128 hex digest of `tensor`'s dtype, shape and bytes (see the module docstring)."""
    # Fast path (one cheap check per property, no detach): a plain contiguous CPU tensor.
    if not (
        type(tensor) in _PLAIN_TYPES
        and tensor.is_cpu
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not (tensor.is_conj() or tensor.is_neg() or tensor.is_quantized)
    ):
        tensor = _logical_cpu_tensor(tensor)
    hasher = xxhash.xxh3_128(_header(tensor.dtype, tuple(tensor.shape)))
    nbytes = tensor.nbytes
    if nbytes:
        # A view of the tensor's own memory: zero copy. `tensor` stays alive until we return.
        hasher.update((ctypes.c_char * nbytes).from_address(tensor.data_ptr()))
    return hasher.hexdigest()


def fingerprint_many(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> dict[str, str] | list[str]:
    """Fingerprints of many tensors (a state dict: name -> hash; an iterable: a list).

    The fast path for many small tensors: one loop with no per-tensor allocation beyond the
    hasher, cached headers, and tensors read in place. Non-tensor values in a mapping (an
    optimizer's python ints, say) are skipped.
    """
    if isinstance(tensors, Mapping):
        return {name: fingerprint(t) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    return [fingerprint(t) for t in tensors]
