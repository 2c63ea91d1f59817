"""CPU gemm (mm, bmm) on our own compiled kernel (`kernels/gemm.cpp`): the order of every output's
sum is fixed by construction, so a row's bits depend only on that row, K and the other operand,
and the same bits come out on every CPU, ISA variant and thread count.

Order ("v1", `blocks=1`, the default of `mm` / `bmm` here): C[i, j] = one sequential fma chain over k = 0..K-1
ascending, starting from +0.0, whatever M, the batch, the thread count, the B layout or the ISA
(see `kernels/ta_gemm.h`). Order "v2" (`blocks=tree_blocks(K)`): the blocked halving tree. P(K) =
the largest power of two P with K % P == 0 and K / P >= 64 (1 when none > 1); block b (k in
[b bs, (b+1) bs), bs = K / P) is v1's chain over that block; the P block sums are combined by
node [lo, hi) = node [lo, mid) + node [mid, hi), mid = (lo + hi) / 2 (left + right). P = 1 is v1.
Since P(K/2) == P(K)/2 for P(K) >= 2, for t | P(K) the v2 partials of the t contiguous K-shards,
combined by `tree_combine`, are the unsharded v2 result bit for bit. The backend entry points
`backend_mm` / `backend_bmm` (what `cpu.mm` / `cpu.bmm` are, so every batch-invariant gemm) use
the process-wide order (`batch_invariant.order`: v2 unless a run or a block says v1).

Guarantees:
- `mm(a, b)` and `bmm(a, b)` give, for each output row, the same bits whatever other rows are
  computed with it, on every ISA variant (`_lib.available_isas()`), for any thread count, and for
  either storage of B ([K, N] row-major, or B = W.t() of a row-major weight W [N, K]).
- Nothing of MKL or oneDNN runs here, and nothing here calls an aten op the override mode
  replaces (only allocation and dtype casts), so the kernel never re-enters the mode.
- bfloat16 / float16 inputs are upcast to float32 (their products are exact there) and the result
  is rounded once to the output dtype; float64 stays float64 (a float64 kernel with the same order).
- Packed weights: packing B into the kernel's 32-column panels costs about two M=1 products, so a
  B seen a second time unchanged (a parameter's: the first time) is served from a bounded cache
  (`PackedCache`). After an in-place update the entry's buffer is repacked where it is (unless a
  product elsewhere still holds it). An entry is keyed by the identity of the tensor owning B's
  memory (held by weakref, so a freed-and-reused address never matches), B's data pointer, shape,
  strides and dtype, and it is valid only while the owner's version counter (`_version`, bumped by
  every in-place op, e.g. an optimizer step) is unchanged. Writes that bypass the version counter
  (through `.data`, numpy or DLPack) are not seen: call `clear_packed_cache()` after such a write.
  The cache changes no bit (packing is a copy). FSDP2 writes its gathered parameters behind the
  version counter: trainer/fsdp.py turns the cache off in a process that shards a model
  (`disable_packed_cache`).
- Under `torch.compile` the product runs as the custom op `titan_audit::mm` / `titan_audit::bmm`
  (opaque to the compiler, a fake kernel gives its shape), in eager the kernel is called directly;
  both run the same kernel, so compiled and eager bits are equal.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.order import gemm_blocks, tree_blocks, tree_combine  # noqa: F401 (re-exported)

PANEL = 32  # packed panel width (ta::gemm::PANEL)
PACKED_CACHE_MAX_BYTES = 1 << 30  # the packed-weight cache's bound (least recently used go first)

_I64 = ctypes.c_int64
_P = ctypes.c_void_p
for _t in ("f32", "f64"):
    _lib.declare(f"gemm_{_t}", None, [_P])  # one pointer to GemmArgs (gemm.cpp): 18 int64
    _lib.declare(f"gemm_pack_{_t}", None, [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, ctypes.c_int])
_lib.declare("gemm_packed_elems", _I64, [_I64, _I64])
# GemmArgs: batch, M, N, K, a, sab, sam, sak, b, sbb, sbk, sbn, packed, c, scb, scm, nthreads, blocks.
# Passed by one pointer (18 converted ctypes arguments cost ~4 us a call, more than a small product).
_ARGS = struct.Struct("18q")
_ARGS_BUFFERS = threading.local()  # one per thread: the kernel runs with the GIL released
# A B smaller than this (elements) is packed per call rather than looked up in the cache.
CACHE_MIN_ELEMS = 1 << 14
AXPY_MAX_ROWS = 2  # gemm.cpp TA_GEMM_AXPY_ROWS: up to this many rows stream a row-major B in place


def _args_buffer() -> tuple[bytearray, int]:
    found = getattr(_ARGS_BUFFERS, "buffer", None)
    if found is None:
        buf = bytearray(_ARGS.size)
        found = (buf, ctypes.addressof((ctypes.c_char * _ARGS.size).from_buffer(buf)))
        _ARGS_BUFFERS.buffer = found
    return found


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


def packed_elems(k: int, n: int) -> int:
    """Elements of one packed K x N B: ceil(N / 32) * 32 * K."""
    return -(-n // PANEL) * PANEL * k


def pack(b: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """B [K, N] (any strides, float32 or float64) packed into the kernel's panels (a copy), into
    `into` when given (a packing of a B of this shape and dtype, overwritten)."""
    k, n = b.shape
    packed = _lib.output((packed_elems(k, n),), b.dtype) if into is None else into  # every panel written
    assert packed.shape == (packed_elems(k, n),) and packed.dtype == b.dtype, (packed.shape, b.shape)
    if packed.numel():
        _lib.kernel(f"gemm_pack_{_suffix(b.dtype)}")(
            b.data_ptr(), 1, k, n, 0, b.stride(0), b.stride(1), packed.data_ptr(), _lib.num_threads()
        )
    return packed


# ---------------------------------------------------------------- the packed-weight cache


@dataclass
class _Entry:
    owner: weakref.ref
    version: int
    packed: torch.Tensor | None  # None: seen once (packed on the second use)


class PackedCache:
    """Packed copies of B operands seen more than once, bounded in bytes (LRU); see the module doc
    for the key and why a stale entry is never served."""

    def __init__(self, max_bytes: int = PACKED_CACHE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.enabled = True  # off: every product packs B itself (the same bits, no reuse)
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._bytes = 0
        # reentrant: a weakref callback (_forget) may run inside a locked block, when a collection
        # frees an owner there
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """How many packed copies are held (first sights are not counted)."""
        with self._lock:
            return sum(e.packed is not None for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.packed is not None:
            self._bytes -= entry.packed.numel() * entry.packed.element_size()

    def get(self, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """B packed in the compute `dtype` if b was seen before unchanged (a bfloat16 weight is
        then not converted again either); None on a first sight (the kernel packs, same cost),
        except for a parameter's memory (an `nn.Parameter` owns it), packed at once: every
        microbatch and decode step reuses it, so after each optimizer step the first product
        already runs on the new packing instead of the kernel packing it once more."""
        if not self.enabled:
            return None
        owner = b if b._base is None else b._base
        try:
            version = b._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter: never cached
            return None
        key = (id(owner), b.data_ptr(), tuple(b.shape), tuple(b.stride()), b.dtype)
        stale = None  # the packing of this B before an in-place update: repacked where it is
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.owner() is owner and entry.version == version:
                self._entries.move_to_end(key)
                if entry.packed is not None:
                    return entry.packed
            elif entry is not None:
                if entry.owner() is owner:
                    stale = entry.packed
                self._drop(key)
                entry = None
        if stale is not None and sys.getrefcount(stale) > 2:  # a product elsewhere still reads it
            stale = None
        seen = entry is not None or stale is not None or isinstance(owner, torch.nn.Parameter)
        packed = pack(b if b.dtype == dtype else b.to(dtype), stale) if seen else None
        with self._lock:
            if key in self._entries:
                self._drop(key)
            if packed is not None and packed.numel() * packed.element_size() > self.max_bytes:
                return packed
            self._entries[key] = _Entry(weakref.ref(owner, lambda _r, k=key: self._forget(k)), version, packed)
            if packed is not None:
                self._bytes += packed.numel() * packed.element_size()
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(self._entries)))
        return packed

    def _forget(self, key: tuple) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.owner() is None:
                self._drop(key)


PACKED_CACHE = PackedCache()


def clear_packed_cache() -> None:
    """Forget every packed B (needed only after writes that bypass the version counter)."""
    PACKED_CACHE.clear()


def disable_packed_cache() -> None:
    """No packed B is kept from now on in this process: for parameters whose memory is written
    behind the version counter on every use. FSDP2 does that (its all-gather copy-out into the
    unsharded parameters runs under `_unsafe_preserve_version_counter`, and the re-allocated
    storage often lands at the same address), so a cached packing would serve the previous
    weights; and it re-gathers them for every forward and backward, so there is nothing to reuse."""
    PACKED_CACHE.enabled = False
    PACKED_CACHE.clear()


# ---------------------------------------------------------------- the kernels


def _gemm(
    batch: int,
    m: int,
    n: int,
    k: int,
    a: torch.Tensor,
    sa: tuple[int, int, int],
    b: torch.Tensor,
    sb: tuple[int, int, int],
    packed: torch.Tensor | None,
    blocks: int = 1,
) -> torch.Tensor:
    """C [batch, M, N] (new, contiguous) = A @ B with A's / B's element strides (batch, row, k) and
    (batch, k, col); one compute dtype (float32 or float64) for all three."""
    c = _lib.output((batch, m, n), a.dtype)
    buf, addr = _args_buffer()
    _ARGS.pack_into(
        buf,
        0,
        batch,
        m,
        n,
        k,
        a.data_ptr(),
        sa[0],
        sa[1],
        sa[2],
        b.data_ptr(),
        sb[0],
        sb[1],
        sb[2],
        0 if packed is None else packed.data_ptr(),
        c.data_ptr(),
        m * n,
        n,
        torch.get_num_threads(),
        blocks,
    )
    _lib.kernel("gemm_f64" if a.dtype == torch.float64 else "gemm_f32")(addr)
    return c


def _upcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _check_blocks(k: int, blocks: int) -> None:
    if blocks < 1 or blocks & (blocks - 1) or (k and k % blocks):
        raise ValueError(f"matmul: blocks={blocks} must be a power of two dividing K={k}")


def _mm_eager(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    out_dtype = a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)
    dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros((m, n), dtype=out_dtype)
    a_c = _upcast(a, dtype)
    # With one or two rows a row-major B is streamed in place (the kernel's rows_axpy: no packing
    # to save); otherwise a cached packed copy saves the per-call packing or strided reads.
    packed = None
    if (b.stride(1) != 1 or m > AXPY_MAX_ROWS) and k * n >= CACHE_MIN_ELEMS:
        packed = PACKED_CACHE.get(b, dtype)
    b_c = b if packed is not None else _upcast(b, dtype)  # with `packed`, the kernel never reads b
    sa, sb = a_c.stride(), b_c.stride()
    out = _gemm(1, m, n, k, a_c, (0, sa[0], sa[1]), b_c, (0, sb[0], sb[1]), packed, blocks).view(m, n)
    return out if out_dtype == dtype else out.to(out_dtype)


def _bmm_eager(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    out_dtype = a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)
    dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0 or k == 0:
        return a.new_zeros((batch, m, n), dtype=out_dtype)
    a_c = _upcast(a, dtype)
    b_c = _upcast(b, dtype)
    out = _gemm(batch, m, n, k, a_c, a_c.stride(), b_c, b_c.stride(), None, blocks)
    return out if out_dtype == dtype else out.to(out_dtype)


@torch.library.custom_op("titan_audit::mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    return _mm_eager(a, b, blocks)


@_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.promote_types(a.dtype, b.dtype))


@torch.library.custom_op("titan_audit::bmm", mutates_args=())
def _bmm_op(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    return _bmm_eager(a, b, blocks)


@_bmm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.promote_types(a.dtype, b.dtype))


def mm(a: torch.Tensor, b: torch.Tensor, *, blocks: int = 1) -> torch.Tensor:
    """a [M, K] @ b [K, N] in a's compute dtype; row i of the result depends on a[i] and b only.
    blocks: the tree's block count (1 = v1, tree_blocks(K) = v2; see the module doc)."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    _check_blocks(a.shape[1], blocks)
    if torch.compiler.is_compiling():
        return torch.ops.titan_audit.mm(a, b, blocks)
    return _mm_eager(a, b, blocks)


def bmm(a: torch.Tensor, b: torch.Tensor, *, blocks: int = 1) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; row (j, i) of the result depends on a[j, i] and b[j] only.
    blocks: as in `mm`."""
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
    _check_blocks(a.shape[2], blocks)
    if torch.compiler.is_compiling():
        return torch.ops.titan_audit.bmm(a, b, blocks)
    return _bmm_eager(a, b, blocks)


def backend_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mm` in the process-wide gemm order (`batch_invariant.order.gemm_blocks`)."""
    return mm(a, b, blocks=gemm_blocks(a.shape[1]))


def backend_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`bmm` in the process-wide gemm order."""
    return bmm(a, b, blocks=gemm_blocks(a.shape[2]))
