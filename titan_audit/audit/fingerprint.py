"""Tensor fingerprints: xxh3-128 of the bytes for a tensor of at most C bytes, an order-free
lattice digest of (index, bits) over the elements above that, so that each rank can hash the
elements it holds.

Guarantee: two tensors get the same fingerprint iff they have the same dtype, the same shape and
the same bits at every row-major position (up to the collision bounds below). So -0.0 and +0.0
differ, NaN payloads count, and equal bytes under another dtype or shape differ. Strides,
storage offset, device, autograd state and how a DTensor is sharded do not count: the *logical*
tensor is hashed. Every dtype goes through its bits, never through a float conversion.

Two definitions, by the tensor's size in bytes (C = `whole_hash_bytes()`, 2 MiB; the same C on
every rank and in every run compared; `whole_hash_limit` changes it for tests and benches):
- at most C bytes (stable since v1; changing it changes every golden file):
    header = b"titan-audit.tensor.v1|" + dtype name (e.g. b"bfloat16") + b"|" + shape as
             comma-separated decimal (b"" for a 0-d tensor) + b"|"
    digest = xxh3_128(header + row-major little-endian bytes of the tensor).hexdigest()
  A DTensor this small is gathered (its pieces, to the rank(s) that hash it) and hashed whole.
- above C: the lattice digest. The tensor is read as words (the element's bits for 1-, 2- and
  4-byte dtypes; an 8-byte element is 2 words, a 16-byte one 4, low half first) at global word
  index j = row-major element index * words per element + k. Two lanes, each a sum modulo 2^64
  of one term per word (batch_invariant/cpu/lattice.py, kernels/lattice.cpp; version 2):
      lane L += B_L(floor(j / 4096)) * ((word ^ X_L) * T_L[j mod 4096])
  with T_L[t] odd 32-bit keys (a fixed table of 4096), B_L(b) odd 64-bit keys (a 64-bit
  bijection of the block index b) and the inner product exact in 64 bits. With (k_0, k_1) the
  two 64-bit halves of xxh3_128(b"titan-audit.tensor.lattice.v2|" + dtype name + b"|" + shape +
  b"|"):
    digest = "%016x%016x" % ((lane_0 + k_0) mod 2^64, (lane_1 + k_1) mod 2^64)
  A sum does not depend on order, so a rank adds the terms of the elements it holds and only the
  16 bytes of its two lanes travel (audit/shards.py, audit/exchange.py): the same digest at any DP, FSDP2 (uneven
  dim-0 chunks included), TP (dim 0 or 1) or composed layout, from one pass over each rank's
  own memory (our compiled kernel, vectorised; threads split it without changing the sum).
  Version 1 (the key b"...lattice.v1|", one 64-bit bijection of (index, word) per term and lane)
  cost four 64-bit multiplies a word; checkpoints written with it (hashes.json format 2) are
  still checked with it (`lattice.using_version`); run records written with it differ from
  version 2's above C (the run manifest's `digest` says which: audit/run_manifest.py).

What the lattice digest detects, for two tensors of one dtype and shape (docs/audit.md):
- a change confined to one word (one element of at most 4 bytes: any bit pattern): always, in
  both lanes: the term moves by B * T * d mod 2^64 with d the difference of the two xor-ed words
  (0 < |d| < 2^32) and B * T odd, hence invertible mod 2^64: never 0;
- any other difference (several elements, two elements swapped, a shifted row): both lanes'
  sums of the term differences must cancel mod 2^64. For keys modelled as random odd numbers
  that happens with probability about 2^-31 per lane for differences inside one block of 4096
  words (the inner sum is NH's universal hash, whose bound this is) and about 2^-63 per lane
  across blocks (B multiplies each block's inner sum), so about 2^-62 per pair of tensors with
  the two independent lanes: a 64-bit checksum's order (version 1 claimed 2^-128 under the
  random-function model, at 3-4x the cost). It is a checksum against accidents, not a MAC: someone
  choosing the data to collide can.
- another dtype or shape: the header's key differs (a collision needs lane differences equal
  to the keys' difference: 2^-128 for the hashed keys).

A contiguous CPU tensor is read in place (zero copy); a tensor on a GPU above C is hashed on
its device (audit/device_lanes.py: the same lanes, no host copy), one of at most C is copied to
the host; a DTensor is hashed by `fingerprint` as its logical tensor: every rank of its mesh
must call it together (a collective; every rank gets the digest).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable, Iterator, Mapping

import torch
import xxhash

from titan_audit.audit import exchange, pieces, shards
from titan_audit.batch_invariant.cpu import lattice as _lattice

HEADER_PREFIX = b"titan-audit.tensor.v1|"
LATTICE_PREFIXES = {1: b"titan-audit.tensor.lattice.v1|", 2: b"titan-audit.tensor.lattice.v2|"}
WHOLE_HASH_BYTES = 2 << 20  # C: the tiny goldens' largest record (embed_tokens [2048, 256] fp32) is exactly this
_MASK = (1 << 64) - 1

_whole_bytes = WHOLE_HASH_BYTES
_header_cache: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}
_key_cache: dict[tuple[int, torch.dtype, tuple[int, ...]], tuple[int, int]] = {}


def whole_hash_bytes() -> int:
    """C: tensors of at most this many bytes are hashed whole by xxh3-128, larger ones by lanes."""
    return _whole_bytes


@contextlib.contextmanager
def whole_hash_limit(nbytes: int) -> Iterator[None]:
    """Use C = `nbytes` inside (tests and benches: a small C puts small tensors on the lattice
    path; digests made under different C do not compare)."""
    global _whole_bytes
    if nbytes < 0:
        raise ValueError(f"whole_hash_limit: nbytes must be >= 0, got {nbytes}")
    previous, _whole_bytes = _whole_bytes, int(nbytes)
    try:
        yield
    finally:
        _whole_bytes = previous


def _header(dtype: torch.dtype, shape: tuple[int, ...], prefix: bytes = HEADER_PREFIX) -> bytes:
    key = (dtype, shape)
    header = _header_cache.get(key) if prefix is HEADER_PREFIX else None
    if header is None:
        name = str(dtype).removeprefix("torch.")
        header = b"%s%s|%s|" % (prefix, name.encode(), ",".join(map(str, shape)).encode())
        if prefix is HEADER_PREFIX and len(_header_cache) < 65536:
            _header_cache[key] = header
    return header


def lattice_digest(dtype: torch.dtype, shape: tuple[int, ...], lanes: tuple[int, int]) -> str:
    """The lattice digest (module doc) of a tensor of `dtype` and `shape` whose words' two lanes
    (all its elements, added up, in `lattice.version()`) are `lanes`."""
    version = _lattice.version()
    key = (version, dtype, tuple(shape))
    keys = _key_cache.get(key)
    if keys is None:
        whole = xxhash.xxh3_128(_header(dtype, tuple(shape), LATTICE_PREFIXES[version])).intdigest()
        keys = (whole >> 64, whole & _MASK)
        if len(_key_cache) < 65536:
            _key_cache[key] = keys
    return f"{(lanes[0] + keys[0]) & _MASK:016x}{(lanes[1] + keys[1]) & _MASK:016x}"


def _logical_tensor(tensor: torch.Tensor, *, contiguous: bool = True, to_cpu: bool = True) -> torch.Tensor:
    """The tensor's logical value as a plain tensor on the CPU (`to_cpu`; else on its device),
    no copy when it is one already (`contiguous`: made contiguous). A DTensor here is gathered
    (`whole_digest` only)."""
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
    if to_cpu and tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous() if contiguous else tensor


def _unwrap_subclass(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if isinstance(tensor, torch.nn.Parameter) or type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return tensor.as_subclass(torch.Tensor)
    raise ValueError(f"cannot fingerprint tensor subclass {type(tensor).__name__}")


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _is_plain_contiguous(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in _PLAIN_TYPES
        and tensor.is_cpu
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not (tensor.is_conj() or tensor.is_neg() or tensor.is_quantized)
    )


def _xxh3(tensor: torch.Tensor) -> str:
    """xxh3-128 of the header and the bytes of a plain contiguous CPU tensor, read in place."""
    hasher = xxhash.xxh3_128(_header(tensor.dtype, tuple(tensor.shape)))
    nbytes = tensor.nbytes
    if nbytes:
        # A view of the tensor's own memory: zero copy. `tensor` stays alive until we return.
        hasher.update((ctypes.c_char * nbytes).from_address(tensor.data_ptr()))
    return hasher.hexdigest()


def whole_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the header and all the bytes, at any size (the definition at most C bytes
    use; a checkpoint of hashes.json format 1 holds it for every tensor). A DTensor is gathered
    (`full_tensor()`, a collective)."""
    return _xxh3(tensor if _is_plain_contiguous(tensor) else _logical_tensor(tensor))


def fingerprint(tensor: torch.Tensor) -> str:
    """The tensor's fingerprint (module doc): xxh3-128 up to C bytes, the lattice digest above.
    A DTensor: collective over its mesh, no gather above C."""
    if type(tensor) not in _PLAIN_TYPES and pieces.is_dtensor(tensor):
        return _fingerprint_dtensor(tensor)
    if _is_plain_contiguous(tensor) and tensor.nbytes <= _whole_bytes:
        return _xxh3(tensor)  # the fast path: a plain contiguous CPU tensor, read in place
    plain = _logical_tensor(tensor, contiguous=False, to_cpu=False)  # above C a device hashes its own
    if plain.numel() * plain.element_size() <= _whole_bytes:
        return _xxh3(plain.cpu().contiguous())
    return lattice_digest(plain.dtype, tuple(plain.shape), shards.whole_lanes(plain))


def _fingerprint_dtensor(tensor: torch.Tensor) -> str:
    if tensor.is_meta:
        raise ValueError("cannot fingerprint a meta tensor: it has no data")
    (combined,) = exchange.combine([(tensor, False, None)], whole_bytes=_whole_bytes, partial_stats=None)
    assert combined is not None, "every rank receives a fingerprint"
    if combined.full is not None:
        return _xxh3(combined.full)
    return lattice_digest(tensor.dtype, tuple(tensor.shape), combined.lanes)


def fingerprint_many(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> dict[str, str] | list[str]:
    """Fingerprints of many tensors (a state dict: name -> hash; an iterable: a list).

    The fast path for many small tensors: one loop with no per-tensor allocation beyond the
    hasher, cached headers, and tensors read in place. Non-tensor values in a mapping (an
    optimizer's python ints, say) are skipped.
    """
    if isinstance(tensors, Mapping):
        return {name: fingerprint(t) for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    return [fingerprint(t) for t in tensors]
