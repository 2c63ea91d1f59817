"""The lattice lanes of the elements a rank holds (its `Piece`, audit/pieces.py): what each rank
computes over its own piece (audit/exchange.py adds the ranks' results up; audit/fingerprint.py
defines the digests built on them).

Guarantees:
- `lanes(local, piece, positions)`: the lattice lanes (batch_invariant/cpu/lattice.py) of the
  elements at `positions` of `local` (all of them by default), each at its global word index in
  the logical tensor. Every dtype goes through its bits: a word is the element (1, 2 or 4
  bytes), an 8-byte element is 2 words and a 16-byte complex one 4 (little-endian halves, at
  word indices q*i .. q*i+q-1 of element i). So the lanes of disjoint pieces add up, modulo
  2^64, to the lanes of the whole tensor, whatever the layout. Memory is read in place: a
  strided view costs nothing unless its last dimension is not contiguous (then one copy). A
  piece on another device (a GPU rank's) is hashed there (audit/device_lanes.py: the same
  integers, no host copy).
- `sums(local, piece, positions)` and `share_sums(local, where)`: `lanes` and `share_lanes` as
  int64 [2] (the lanes' bits), left on the device that hashed them: a GPU piece's lanes are not
  read back, so a caller exchanging many tensors' lanes waits for the device once, not once a
  tensor (audit/exchange.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from titan_audit.audit import device_lanes
from titan_audit.audit.pieces import Piece, share_of, share_rows
from titan_audit.batch_invariant.cpu import lattice as _kernel

_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# ------------------------------------------------------------------ lanes of a piece


def _words(local: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, Piece]:
    """The local tensor as unsigned-word view (1, 2 or 4 bytes) and its piece over word indices."""
    if local.layout is not torch.strided or local.is_quantized:
        raise ValueError(f"cannot hash a tensor with layout {local.layout} (quantized: {local.is_quantized})")
    if local.is_conj():
        local = local.resolve_conj()
    if local.is_neg():
        local = local.resolve_neg()
    index, shape = list(piece.index), list(piece.shape)
    if local.dim() and local.stride(-1) != 1:
        local = local.contiguous()
    if local.dim() == 0:
        local, index, shape = local.reshape(1), [torch.zeros(1, dtype=torch.int64)], [1]
    if local.is_complex():
        local = torch.view_as_real(local)
        index, shape = [*index, torch.arange(2)], [*shape, 2]
    itemsize = local.element_size()
    if itemsize > 4:
        q = itemsize // 4
        local = local.view(torch.int32).unflatten(-1, (-1, q))
        index, shape = [*index, torch.arange(q)], [*shape, q]
    else:
        local = local.view(_WORD_DTYPES[itemsize])
    return local, Piece(tuple(shape), tuple(index))


def _flat_words(local: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as one row of words (`_words`' widths: an element of 8 or 16
    bytes is 2 or 4 int32 words, a complex one its real and imaginary parts in turn)."""
    flat = local.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    size = flat.element_size()
    return flat.view(_WORD_DTYPES[size] if size <= 4 else torch.int32)


def _consecutive(idx: torch.Tensor) -> bool:
    return len(idx) <= 1 or bool((idx[1:] - idx[:-1] == 1).all())


def row_tables(
    local_strides: Sequence[int], piece: Piece, positions: Sequence[torch.Tensor]
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(run, local word offsets, global word indices) of the rows the kernel walks: the trailing
    dimensions that are consecutive both in memory and in the logical tensor merge into one run."""
    ndim = len(positions)
    global_strides = [math.prod(piece.shape[d + 1 :]) for d in range(ndim)]
    glob = [idx if len(pos) == len(idx) else idx[pos] for idx, pos in zip(piece.index, positions)]
    run, k = 1, ndim
    while k > 0:
        d = k - 1
        if not (local_strides[d] == run and global_strides[d] == run):
            break
        if not (_consecutive(positions[d]) and _consecutive(glob[d])):
            break
        run *= len(positions[d])
        k -= 1
    local_off = torch.zeros((), dtype=torch.int64)
    global_off = torch.zeros((), dtype=torch.int64)
    for d in range(k, ndim):  # the run's start
        local_off = local_off + positions[d][0] * local_strides[d]
        global_off = global_off + glob[d][0] * global_strides[d]
    for d in range(k):  # one row per position of the outer dimensions, row-major
        view = [1] * k
        view[d] = -1
        local_off = local_off + (positions[d] * local_strides[d]).view(view)
        global_off = global_off + (glob[d] * global_strides[d]).view(view)
    shape = [len(p) for p in positions[:k]]
    return run, local_off.expand(shape).reshape(-1).contiguous(), global_off.expand(shape).reshape(-1).contiguous()


def hashed_on_device(local: torch.Tensor) -> bool:
    """Whether `lanes` hashes `local` on its own device (torch ops) rather than with the CPU
    kernel: a tensor on any device but the CPU."""
    return local.device.type != "cpu"


def lanes(
    local: torch.Tensor, piece: Piece, positions: Sequence[torch.Tensor] | None = None, threads: int | None = None
) -> tuple[int, int]:
    """The lattice lanes of the elements at `positions` of `local` (default: all), which holds
    `piece` of its logical tensor (module doc)."""
    sums = _lanes(local, piece, positions, threads)
    return device_lanes.read_lanes(sums) if isinstance(sums, torch.Tensor) else sums


def _lanes(
    local: torch.Tensor, piece: Piece, positions: Sequence[torch.Tensor] | None, threads: int | None
) -> tuple[int, int] | torch.Tensor:
    """`lanes`, or for a piece hashed on its device its two sums there (not read)."""
    if tuple(local.shape) != piece.local_shape and not (local.dim() == 0 and piece.local_shape == ()):
        raise ValueError(f"lanes: local shape {tuple(local.shape)} is not the piece's {piece.local_shape}")
    local, on_device = _hashed_where(local)
    if local.numel() == 0 or (positions is not None and any(len(p) == 0 for p in positions)):
        return 0, 0
    first = _row_block_start(local, piece) if positions is None else None
    if first is not None:
        return _device_block(local, first) if on_device else _block_lanes(local, False, first, threads)
    words, run, local_off, global_off = word_rows(local, piece, positions)
    if on_device:
        return device_lanes.lanes_on_device(words, run, local_off, global_off)
    out = _kernel.new_lanes()
    threads = threads or torch.get_num_threads()
    _kernel.rows(out, words.data_ptr(), words.element_size(), run, local_off, global_off, threads)
    return out[0], out[1]


def whole_lanes(tensor: torch.Tensor, threads: int | None = None) -> tuple[int, int]:
    """`lanes(tensor, Piece.whole(tensor.shape))`. When the tensor's memory is its row-major
    value (contiguous, no conj/neg bit) no whole piece is built: its index would hold an int64
    per position of each dimension, for a 1-D tensor 8 bytes an element beside the data."""
    if tensor.numel() and _plain_row_major(tensor):
        return _block_lanes(*_hashed_where(tensor), 0, threads)
    return lanes(tensor, Piece.whole(tensor.shape), threads=threads)


def whole_lanes_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """whole_lanes of a tensor on its device (hashed_on_device, lattice version device_lanes
    computes), left there: int64 [2] before the mask, for a caller that reads many at once."""
    if tensor.numel() and _plain_row_major(tensor):
        return _device_block(tensor, 0)
    return device_lanes.lanes_on_device(*word_rows(tensor, Piece.whole(tensor.shape)))


def share_lanes(local: torch.Tensor, where: Piece | int) -> tuple[int, int]:
    """The lanes of a share as `replicated_share` gives it: `lanes(local, where)` for a piece,
    else those of contiguous `local`'s elements from global element index `where` on."""
    if isinstance(where, Piece):
        return lanes(local, where)
    return _block_lanes(*_hashed_where(local), where, None)


def sums(local: torch.Tensor, piece: Piece, positions: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """lanes(local, piece, positions) as int64 [2] with the lanes' bits: on the device that hashed
    them, not read, for a piece hashed there; on the host otherwise."""
    return _as_sums(_lanes(local, piece, positions, None))


def share_sums(local: torch.Tensor, where: Piece | int) -> torch.Tensor:
    """share_lanes(local, where) as `sums` gives lanes."""
    if isinstance(where, Piece):
        return sums(local, where)
    hashed, on_device = _hashed_where(local)
    return _as_sums(_device_block(hashed, where) if on_device else _block_lanes(hashed, False, where, None))


def _as_sums(lanes_or_sums: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    if isinstance(lanes_or_sums, torch.Tensor):
        return lanes_or_sums
    return torch.tensor([_kernel.to_signed(v) for v in lanes_or_sums], dtype=torch.int64)


def _hashed_where(local: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor to hash, whether on its own device): a device's piece stays there unless the
    kernel's lattice version is one device_lanes does not compute (then the CPU kernel)."""
    on_device = hashed_on_device(local)
    if on_device and _kernel.version() != device_lanes.VERSION:
        return local.cpu(), False
    return local, on_device


def _block_lanes(local: torch.Tensor, on_device: bool, first: int, threads: int | None) -> tuple[int, int]:
    """The lanes of a contiguous `local` whose elements are the logical tensor's consecutive
    elements from global index `first` on: one run of words, no tables, no per-element index."""
    if on_device:
        return device_lanes.read_lanes(_device_block(local, first))
    out = _kernel.new_lanes()
    flat_lanes(out, local, 0, local.numel(), threads or torch.get_num_threads(), first=first)
    return out[0], out[1]


def _device_block(local: torch.Tensor, first: int) -> torch.Tensor:
    words = _flat_words(local)
    start = torch.tensor([first * (words.numel() // local.numel())], dtype=torch.int64)
    return device_lanes.lanes_on_device(words, words.numel(), torch.zeros(1, dtype=torch.int64), start)


def word_rows(
    local: torch.Tensor, piece: Piece, positions: Sequence[torch.Tensor] | None = None
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """(the word view of `local`, run, local word offsets, global word indices): the rows of
    words the lattice kernel (or device_lanes) walks for the elements at `positions` (default
    all; none of them empty) of `local`, which holds `piece`."""
    if positions is None:
        positions = tuple(torch.arange(n) for n in piece.local_shape)
    words, wpiece = _words(local.detach(), piece)
    dims = max(local.dim(), 1)  # a 0-d tensor is hashed as its one element at index 0
    given = tuple(positions) if local.dim() else (torch.zeros(1, dtype=torch.int64),)
    positions = (*given, *(torch.arange(len(i)) for i in wpiece.index[dims:]))
    return words, *row_tables(words.stride(), wpiece, positions)


def replicated_share(tensor: torch.Tensor, part: int, parts: int) -> tuple[torch.Tensor, Piece | int] | None:
    """Share `part` of `parts` of a whole plain tensor (dim-0 rows, as `share_of` splits the
    whole piece): (rows, their piece), or (rows, the global index of their first element) when
    the tensor is plain row-major memory, so that no index is built (the whole piece's holds an
    int64 per row of the whole tensor: 8 bytes an element for a 1-D tensor); None when the share
    is empty."""
    if not _plain_row_major(tensor) or tensor.dim() == 0:
        return share_of(tensor, Piece.whole(tensor.shape), part, parts)
    lo, hi = share_rows(tensor.shape[0], part, parts)
    if hi <= lo:
        return None
    return tensor[lo:hi], lo * math.prod(tensor.shape[1:])


def flat_lanes(out: object, tensor: torch.Tensor, start: int, count: int, threads: int = 1, first: int = 0) -> None:
    """out (kernel lanes) += the lanes of elements [start, start + count) of a plain contiguous
    CPU tensor, at global element indices first + start, ... (first = 0: the tensor is the whole
    logical tensor, as `lanes` gives it)."""
    itemsize = tensor.element_size()
    q, width = (itemsize // 4, 4) if itemsize > 4 else (1, itemsize)
    _kernel.span(out, tensor.data_ptr() + start * itemsize, width, count * q, (first + start) * q, threads)


def _plain_row_major(local: torch.Tensor) -> bool:
    return (
        local.layout is torch.strided
        and not (local.is_quantized or local.is_conj() or local.is_neg())
        and local.is_contiguous()
    )


def _row_block_start(local: torch.Tensor, piece: Piece) -> int | None:
    """The global element index of `local`'s first element when it is a block of whole dim-0
    rows in plain row-major memory (a whole tensor, an FSDP2 shard), else None."""
    if not _plain_row_major(local):
        return None
    if not piece.index:  # 0-d: its one element
        return 0
    if piece.local_shape[1:] != piece.shape[1:]:
        return None
    rows = piece.index[0]
    start = int(rows[0])
    if int(rows[-1]) - start + 1 != len(rows):  # ascending and distinct: consecutive iff this
        return None
    return start * math.prod(piece.shape[1:])


def new_lanes() -> object:
    return _kernel.new_lanes()
