"""One audit record's tensor columns: dtype, shape, fingerprint, absmax and mean.

Guarantees:
- `hash` is `audit.fingerprint` of the logical tensor (raw bits; see fingerprint.py): up to C
  bytes the same header (`fingerprint._header`) and the same bytes go into the same xxh3-128
  (python-xxhash, as in `fingerprint`); above C the same lattice lanes (our kernel, piece by
  piece below), so two summaries have the same hash iff the tensors are bitwise equal (up to
  the collision bounds of fingerprint.py). tests/audit/test_summary.py and
  test_lattice_digest.py check it against `fingerprint` for every dtype and layout, and across
  the pieces below.
- `absmax` and `mean` are informational (they are never compared; the hash is): float64
  numbers, NaN when the tensor is empty, NaN/inf propagated from the data, None (null in the
  log) when the caller asked for no statistics. For float32, bfloat16 and float64 they come from
  one pass of our compiled kernel (batch_invariant/cpu/stats.py, kernels/stats.cpp): absmax is
  exact; mean = the sum in the kernel's fixed order (float32 lanes per 1024-element block, then
  float64 lanes and a fixed tree; float64 input: float64 lanes) / numel, the same bits on every
  CPU, ISA and thread count. A tensor of at most C bytes goes to the hasher and the kernel in
  one call that runs them at once on two intra-op threads (batch_invariant/cpu/digest.py
  `xxh3_128_stats`), so the record takes one read of its bytes in wall time instead of two.
  float16 and the float8 types are widened to float32 first (exact); integer and bool
  tensors take numpy's min/max and an int64 torch sum; complex: NaN. The statistics cost about
  0.6x the hash.
- A DTensor is never materialised whole (`summarize_sharded`, a collective: every rank of its
  mesh summarises it together): above C each rank hashes its own piece and sends 16 bytes of
  lanes (plus its absmax and sum when statistics are asked), at most C its piece goes to the
  receiving rank, which hashes the whole tensor as unsharded. So the hash does not depend on
  the sharding; absmax is exact; mean is the ranks' partial sums added in the group's rank
  order, divided by numel: its last bits may depend on the layout (it is informational).
- A tensor on a GPU (or a rank's GPU piece) above C is hashed and summarised on its device
  (audit/device_lanes.py: the same hash; absmax exact, the sum torch's float64 sum there, so a
  mean's last bits may differ from a CPU run's); one of at most C is copied to the CPU once.
- `summarize_later` / `read_back`: the same summaries of plain GPU tensors without waiting for
  the GPU per record. summarize_later queues the work on the device's current stream at once
  (above C the lanes and statistics stay there as 32 bytes; at most C the bytes are copied to
  pinned host memory without blocking), so what is done to the tensor afterwards (an in-place
  op, its memory freed and reused; `record_stream` covers a tensor made on another stream),
  queued after it, cannot change the record; read_back of many waits once per device and
  copies their values in one transfer.
- Per-(dtype, shape) text (dtype name, shape, hash header) is cached, so a record of a small
  tensor costs a few microseconds of Python.
- `summarize_many` / `summarize_batch`: the summaries without statistics of many tensors, the
  same bits as summarize() of each; the plain contiguous CPU tensors of at most C bytes go to one
  call of our xxh3 kernel (batch_invariant/cpu/digest.py: xxHash's own code, checked against
  python-xxhash in tests/audit/test_summary_batch.py), which hashes them on several threads,
  whole tensors per thread.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import xxhash

from titan_audit.audit import device_lanes, exchange, pieces, shards
from titan_audit.audit.fingerprint import _header, fingerprint, lattice_digest, whole_hash_bytes
from titan_audit.batch_invariant.cpu import lattice as _lattice
from titan_audit.batch_invariant.cpu import stats as _stats
from titan_audit.batch_invariant.cpu.digest import xxh3_128_many, xxh3_128_stats

# The piece size above C, per thread: the lattice lanes of a piece, then the statistics kernel
# over it from L2 (whole kernel blocks of every dtype).
_LATTICE_CHUNK_BYTES = 1 << 20
assert all(_LATTICE_CHUNK_BYTES % (_stats.BLOCK * dtype.itemsize) == 0 for dtype in _stats.DTYPES), "whole blocks"
_KERNEL = dict(_stats.KERNELS)
_WIDEN = {torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
_NUMPY_MINMAX = {torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_STATE_LANES = _stats.LANES


class Summary(NamedTuple):
    dtype: str
    shape: str
    hash: str
    absmax: float | None
    mean: float | None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_text(shape: torch.Size | tuple[int, ...]) -> str:
    return str(list(shape))


class _Meta(NamedTuple):
    header: bytes
    dtype: str
    shape: str
    numel: int
    nbytes: int
    buffer: type | None  # ctypes.c_char * nbytes: a zero-copy view of the tensor's memory


_meta_cache: dict[tuple[torch.dtype, tuple[int, ...]], _Meta] = {}


def _meta(dtype: torch.dtype, shape: torch.Size) -> _Meta:
    key = (dtype, shape)
    meta = _meta_cache.get(key)
    if meta is None:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        meta = _Meta(
            _header(dtype, tuple(shape)),
            dtype_name(dtype),
            shape_text(shape),
            numel,
            nbytes,
            ctypes.c_char * nbytes if nbytes else None,
        )
        if len(_meta_cache) < 65536:
            _meta_cache[key] = meta
    return meta


def plain_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The logical value of `tensor` as a plain, contiguous CPU tensor (a DTensor is gathered:
    for full-value dumps; summarize() takes a DTensor as its pieces)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if type(tensor) is not torch.Tensor and pieces.is_dtensor(tensor):
        tensor = tensor.full_tensor()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def _is_plain(t: torch.Tensor) -> bool:
    """A plain, strided, contiguous CPU tensor whose memory is its logical value (read in place)."""
    return (
        type(t) in _PLAIN_TYPES
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_contiguous()
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    )


def _on_device(t: torch.Tensor) -> bool:
    """A plain strided tensor whose data `shards.lanes` hashes on its own device (not the CPU)."""
    return (
        type(t) in _PLAIN_TYPES
        and shards.hashed_on_device(t)
        and not t.is_meta
        and t.layout is torch.strided
        and not t.is_quantized
    )


def _kernel_absmax_sum(tensor: torch.Tensor) -> tuple[float, float]:
    state = _stats.new_state()
    _stats.kernel_for(tensor.dtype)(tensor.data_ptr(), tensor.numel(), state)
    return state[_STATE_LANES], state[_STATE_LANES + 1]


def stats(tensor: torch.Tensor) -> tuple[float, float]:
    """(absmax, mean) of a plain contiguous CPU tensor as float64; NaN for empty or complex."""
    absmax, total = absmax_sum(tensor)
    return absmax, total / tensor.numel() if tensor.numel() else math.nan


def absmax_sum(tensor: torch.Tensor) -> tuple[float, float]:
    """(absmax, sum) of a plain CPU tensor as float64 (a rank's partial statistics: the sum in
    the kernel's fixed order); NaN for empty or complex."""
    numel = tensor.numel()
    dtype = tensor.dtype
    if numel == 0 or tensor.is_complex() or tensor.layout is not torch.strided:
        return math.nan, math.nan
    if shards.hashed_on_device(tensor):
        return _device_absmax_sum(tensor)
    if dtype in _KERNEL:
        return _kernel_absmax_sum(tensor.contiguous())
    if dtype in _WIDEN or (dtype.is_floating_point and dtype not in _NUMPY_MINMAX):
        return _kernel_absmax_sum(tensor.float().contiguous())  # exact widening
    if dtype is torch.bool:
        tensor = tensor.view(torch.uint8)
        dtype = torch.uint8
    if dtype in _NUMPY_MINMAX:
        array = tensor.detach().contiguous().numpy()
        low, high = float(array.min()), float(array.max())
    else:  # other integer types
        low_t, high_t = torch.aminmax(tensor)
        low, high = float(low_t), float(high_t)
    return max(abs(low), abs(high)), float(tensor.sum(dtype=torch.int64))


def _device_absmax_sum(tensor: torch.Tensor) -> tuple[float, float]:
    """absmax_sum of a tensor on another device (a GPU rank's piece), computed there: absmax
    exact; the sum is torch's (float64 for floating types, int64 for integers) in the device's
    own order, so a mean's last bits may differ from a CPU run's (it is informational)."""
    absmax, total = _device_stats(tensor).tolist()
    return _one_nan(absmax), total


def _device_stats(tensor: torch.Tensor) -> torch.Tensor:
    """absmax and sum of a non-empty real tensor as float64 [2] on its device (not read); absmax
    is NaN when any element is (torch.maximum propagates it, in whatever NaN the device makes)."""
    if tensor.dtype is torch.bool:
        tensor = tensor.view(torch.uint8)
    elif tensor.dtype in _WIDEN and tensor.dtype is not torch.float16:
        tensor = tensor.float()  # exact; float8 has no aminmax (float16 is read as it is)
    low, high = torch.aminmax(tensor)
    total = tensor.sum(dtype=torch.float64 if tensor.dtype.is_floating_point else torch.int64)
    return torch.stack([torch.maximum(low.double().abs(), high.double().abs()), total.double()])


def partial_stats(local: torch.Tensor) -> torch.Tensor:
    """absmax_sum of a rank's share as float64 [absmax, sum], computed where the share is hashed
    and left there (a GPU piece's: not read, so its record waits for nothing; exchange.combine,
    whose NaN check makes any NaN the one quiet NaN)."""
    if shards.hashed_on_device(local) and local.numel() and not local.is_complex() and local.layout is torch.strided:
        return _device_stats(local)
    return torch.tensor(absmax_sum(local), dtype=torch.float64)


def _one_nan(value: float) -> float:
    """`value`, with any NaN as math.nan (the host's quiet NaN, whatever the device made)."""
    return math.nan if math.isnan(value) else value


def _summarize_on_device(tensor: torch.Tensor, with_stats: bool) -> Summary:
    """summarize() of a plain tensor above C bytes on another device: the lattice lanes and the
    statistics computed there (audit/device_lanes.py), no host copy."""
    tensor = tensor.detach()
    lanes = shards.whole_lanes(tensor)
    absmax = mean = None
    if with_stats:
        absmax, total = absmax_sum(tensor)
        mean = total / tensor.numel()
    digest = lattice_digest(tensor.dtype, tuple(tensor.shape), lanes)
    return Summary(dtype_name(tensor.dtype), shape_text(tensor.shape), digest, absmax, mean)


def _summarize_plain(tensor: torch.Tensor, with_stats: bool) -> Summary:
    """summarize() of a tensor for which `_is_plain` holds."""
    dtype = tensor.dtype
    meta = _meta(dtype, tensor.shape)
    nbytes = meta.nbytes
    if nbytes > whole_hash_bytes():
        return _summarize_lattice(tensor, meta, with_stats)
    if nbytes and with_stats and dtype in _KERNEL:  # the hash and the statistics at once, on two threads
        state = _stats.new_state()
        digest = xxh3_128_stats(meta.header, tensor.data_ptr(), nbytes, dtype, torch.get_num_threads(), state)
        return Summary(meta.dtype, meta.shape, digest, state[_STATE_LANES], state[_STATE_LANES + 1] / meta.numel)
    hasher = xxhash.xxh3_128(meta.header)
    absmax = mean = None
    if nbytes:
        hasher.update(meta.buffer.from_address(tensor.data_ptr()))
    if with_stats:
        absmax, mean = stats(tensor)  # NaN, NaN when empty
    return Summary(meta.dtype, meta.shape, hasher.hexdigest(), absmax, mean)


def _summarize_lattice(tensor: torch.Tensor, meta: _Meta, with_stats: bool) -> Summary:
    """_summarize_plain() above C bytes: the lattice lanes on every intra-op thread, and the
    statistics kernel piece by piece behind them (from cache: a piece is one lattice chunk per
    thread)."""
    dtype = tensor.dtype
    acc = shards.new_lanes()
    absmax = mean = None
    threads = torch.get_num_threads()
    if with_stats and dtype in _KERNEL:
        address, itemsize = tensor.data_ptr(), dtype.itemsize
        state = _stats.new_state()
        kernel = _stats.kernel_for(dtype)
        step = _LATTICE_CHUNK_BYTES * threads // itemsize
        for start in range(0, meta.numel, step):
            count = min(step, meta.numel - start)
            shards.flat_lanes(acc, tensor, start, count, threads)
            kernel(address + start * itemsize, count, state)
        absmax, mean = state[_STATE_LANES], state[_STATE_LANES + 1] / meta.numel
    else:
        shards.flat_lanes(acc, tensor, 0, meta.numel, threads)
        if with_stats:
            absmax, mean = stats(tensor)
    return Summary(meta.dtype, meta.shape, lattice_digest(dtype, tuple(tensor.shape), (acc[0], acc[1])), absmax, mean)


def summarize(tensor: torch.Tensor, *, with_stats: bool = True) -> Summary:
    """dtype, shape, fingerprint and (optionally) absmax/mean of the logical tensor. A DTensor:
    a collective over its mesh (`summarize_sharded`); every rank gets the summary."""
    if _is_plain(tensor):
        return _summarize_plain(tensor, with_stats)  # fast path: read in place
    if type(tensor) not in _PLAIN_TYPES and pieces.is_dtensor(tensor):
        (summary,) = summarize_sharded([(tensor, with_stats, None)])
        assert summary is not None, "every rank receives the summary"
        return summary
    if _on_device(tensor) and tensor.nbytes > whole_hash_bytes():
        return _summarize_on_device(tensor, with_stats)
    plain = plain_cpu(tensor)
    if _is_plain(plain):
        return _summarize_plain(plain, with_stats)
    digest = fingerprint(plain)  # raises for what cannot be fingerprinted (sparse, quantized, meta)
    absmax, mean = stats(plain) if with_stats else (None, None)
    return Summary(dtype_name(plain.dtype), shape_text(plain.shape), digest, absmax, mean)


class Later(NamedTuple):
    """A summary queued on a device by `summarize_later`; `read_back` gives the Summary."""

    device: torch.device
    dtype: torch.dtype
    shape: tuple[int, ...]
    with_stats: bool
    values: torch.Tensor | None  # above C, on the device: int64 lanes [2], then absmax's and sum's float64 bits
    host: torch.Tensor | None  # at most C: the copy on the host, complete once the device is synchronised

    @property
    def held(self) -> int:
        """Bytes it holds until read: its host copy, or a device allocator's smallest block."""
        return self.host.nbytes if self.host is not None else 512


def summarized_later(tensor: torch.Tensor) -> bool:
    """Whether `summarize_later` takes `tensor`: a plain tensor on a device (not the CPU) whose
    lattice lanes device_lanes computes."""
    return _on_device(tensor) and _lattice.version() == device_lanes.VERSION


def summarize_later(tensor: torch.Tensor, *, with_stats: bool) -> Later:
    """summarize() of a tensor `summarized_later` takes, queued on its device's current stream
    now and read by `read_back` (module doc): nothing here waits for the device."""
    tensor = tensor.detach()
    if tensor.is_cuda:  # its memory, once freed, is not reused on its own stream before these reads
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    values = host = None
    if tensor.nbytes > whole_hash_bytes():
        parts = [shards.whole_lanes_on_device(tensor)]
        if with_stats and not tensor.is_complex():
            parts.append(_device_stats(tensor).view(torch.int64))
        values = torch.cat(parts)
    elif tensor.is_cpu:  # a CPU tensor routed here (tests): a copy taken now
        host = tensor.clone()
    else:  # pinned, not blocking: complete once the device is synchronised
        host = tensor.to("cpu", non_blocking=True)
    return Later(tensor.device, tensor.dtype, tuple(tensor.shape), with_stats, values, host)


def read_back(items: Sequence[Later]) -> list[Summary]:
    """The Summaries of `summarize_later`'s results, in order (the same as summarize()'s of the
    tensors as they were): per device one synchronisation and one copy of all the values."""
    read: dict[int, torch.Tensor] = {}
    for device in dict.fromkeys(item.device for item in items):
        if device.type != "cpu":
            torch.accelerator.synchronize(device)  # every pinned copy is complete
        mine = [item for item in items if item.device == device and item.values is not None]
        if mine:
            flat = torch.cat([item.values for item in mine]).cpu()
            for item, values in zip(mine, flat.split([item.values.numel() for item in mine])):
                read[id(item)] = values
    out = []
    for item in items:
        if item.host is not None:
            out.append(summarize(item.host, with_stats=item.with_stats))
            continue
        values = read[id(item)]
        absmax = mean = None
        if item.with_stats:
            absmax, total = values[2:].view(torch.float64).tolist() if len(values) > 2 else (math.nan,) * 2
            absmax, mean = _one_nan(absmax), total / math.prod(item.shape)
        lanes = (int(values[0]) & _lattice.MASK, int(values[1]) & _lattice.MASK)
        digest = lattice_digest(item.dtype, item.shape, lanes)
        out.append(Summary(dtype_name(item.dtype), shape_text(item.shape), digest, absmax, mean))
    return out


def batch_meta(tensor: torch.Tensor) -> _Meta | None:
    """The cached per-(dtype, shape) text of a tensor that `summarize_batch` takes (a plain
    contiguous CPU tensor of at most C bytes), else None."""
    if _is_plain(tensor):
        meta = _meta(tensor.dtype, tensor.shape)
        if meta.nbytes <= whole_hash_bytes():
            return meta
    return None


def batch_metas(tensors: Sequence[torch.Tensor]) -> list[_Meta] | None:
    """[batch_meta(t) for t in tensors] when every one is a tensor `summarize_batch` takes,
    else None (one loop: a step-level call asks it for every parameter each step)."""
    metas = []
    for t in tensors:
        meta = batch_meta(t)
        if meta is None:
            return None
        metas.append(meta)
    return metas


def batch_digests(tensors: Sequence[torch.Tensor], metas: Sequence[_Meta], threads: int = 1) -> list[str]:
    """The hashes `summarize_batch` gives (its module-doc guarantee), without the Summaries."""
    return xxh3_128_many(
        [meta.header for meta in metas], [t.data_ptr() for t in tensors], [meta.nbytes for meta in metas], threads
    )


def summarize_batch(tensors: Sequence[torch.Tensor], metas: Sequence[_Meta], threads: int = 1) -> list[Summary]:
    """summarize(t, with_stats=False) of tensors whose `batch_meta` is `metas` (the same bits):
    one call of our xxh3 kernel (batch_invariant/cpu/digest.py) reads them all in place on
    `threads` threads, each thread taking whole tensors, largest first."""
    digests = batch_digests(tensors, metas, threads)
    return [Summary(meta.dtype, meta.shape, digest, None, None) for meta, digest in zip(metas, digests)]


def summarize_many(tensors: Sequence[torch.Tensor], *, threads: int = 1) -> list[Summary]:
    """summarize(t, with_stats=False) of each tensor (the same bits): those `summarize_batch`
    takes in one kernel call on `threads` threads, the others one by one (above C: the lattice
    lanes on every intra-op thread). A DTensor here is a collective, as in summarize()."""
    out: list[Summary | None] = [None] * len(tensors)
    picked, metas = [], []
    for i, tensor in enumerate(tensors):
        meta = batch_meta(tensor)
        if meta is None:
            out[i] = summarize(tensor, with_stats=False)
        else:
            picked.append(i)
            metas.append(meta)
    for i, summary in zip(picked, summarize_batch([tensors[i] for i in picked], metas, threads)):
        out[i] = summary
    return out


def summarize_sharded(
    items: list[tuple[torch.Tensor, bool, int | None]], counters: exchange.DigestCounters | None = None
) -> list[Summary | None]:
    """Summaries of DTensors (or of plain tensors above C that every rank holds whole, as under
    DDP: exchange.combine), each (tensor, with_stats, dst), from the pieces the ranks hold: on
    rank `dst` (every rank when None), None elsewhere. Collective (audit/exchange.py `combine`):
    every rank of each tensor's mesh calls it with the same items in the same order; one
    exchange per process group and dst for the whole list. A tensor of at most C bytes is
    gathered to dst and summarised whole (the same bits as unsharded); a larger one is hashed
    by each rank over its piece (16 bytes of lanes travel) and its absmax / mean come from the
    ranks' partial statistics: absmax exact, the sum added in the group's rank order, so mean's
    last bits may depend on the layout (informational). `counters`: the bytes this rank hashes
    and receives for them are added to it (exchange.DigestCounters)."""
    combined = exchange.combine(items, whole_bytes=whole_hash_bytes(), partial_stats=partial_stats, counters=counters)
    out: list[Summary | None] = []
    for (tensor, with_stats, _), c in zip(items, combined):
        if c is None:
            out.append(None)
        elif c.full is not None:
            out.append(_summarize_plain(c.full, with_stats))
            if counters is not None:
                counters.hashed_bytes += c.full.nbytes
        else:
            meta = _meta(tensor.dtype, tensor.shape)
            absmax = mean = None
            if with_stats:
                absmax, mean = c.absmax, c.total / meta.numel if meta.numel else math.nan
            digest = lattice_digest(tensor.dtype, tuple(tensor.shape), c.lanes)
            out.append(Summary(meta.dtype, meta.shape, digest, absmax, mean))
    return out
