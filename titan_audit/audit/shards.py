"""The lattice lanes of the elements a rank holds (its `Piece`, audit/pieces.py), and the
few collectives that combine what ranks computed over their own pieces (audit/fingerprint.py
defines the digests built on them; summary.py, recorder.py and trainer/checkpoint.py use them).

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
- `gather(...)`: one collective over a mesh's process group (the default group when the mesh
  spans every rank), to one rank or to all, of one fixed-size tensor per rank; every rank of
  the group must call it in the same order.
- `combine(items)`: what many DTensors' pieces add up to, on the rank that needs it: a tensor
  of more than `whole_bytes` as the sum of the ranks' lanes (and their partial absmax / sum),
  one of at most `whole_bytes` gathered whole; one gather per process group and destination for
  all the items, and none in a group the destination is not part of. A plain tensor that every
  rank holds whole (DDP) is combined like a DTensor replicated over the default group: each
  rank hashes its share of the dim-0 rows, so the work is split W ways (`replicated_share`: a
  view of its rows, no index built when the tensor is row-major memory). With `counters`
  (`DigestCounters`) it adds the tensor bytes this rank hashed and the bytes it received from
  the other ranks (a few integer additions per call).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_audit.audit import device_lanes
from titan_audit.audit.pieces import Piece, coordinate, is_dtensor, piece_of, replica, share_of, share_rows
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
    if tuple(local.shape) != piece.local_shape and not (local.dim() == 0 and piece.local_shape == ()):
        raise ValueError(f"lanes: local shape {tuple(local.shape)} is not the piece's {piece.local_shape}")
    local, on_device = _hashed_where(local)
    if local.numel() == 0 or (positions is not None and any(len(p) == 0 for p in positions)):
        return 0, 0
    first = _row_block_start(local, piece) if positions is None else None
    if first is not None:
        return _block_lanes(local, on_device, first, threads)
    words, run, local_off, global_off = word_rows(local, piece, positions)
    if on_device:
        return device_lanes.row_lanes(words, run, local_off, global_off)
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


# ------------------------------------------------------------------ collectives


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_of(mesh) -> tuple[object | None, list[int]]:
    """(process group, its global ranks in group order) of a DTensor's mesh: the default group
    when the mesh spans every rank, the mesh's own group when it is 1-d."""
    ranks = mesh.mesh.flatten().tolist()
    if mesh.mesh.numel() == dist.get_world_size():
        return None, list(range(dist.get_world_size()))
    if mesh.ndim == 1:
        group = mesh.get_group()
        return group, dist.get_process_group_ranks(group)
    raise ValueError(
        f"a DTensor on a {mesh.ndim}-d mesh of {len(ranks)} of the {dist.get_world_size()} ranks: "
        "its pieces cannot be combined without a process group over them"
    )


def transport_device(group: object | None = None) -> torch.device:
    """The device whose tensors `group`'s backend moves: this rank's GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather(
    tensor: torch.Tensor, group: object | None, ranks: Sequence[int], dst: int | None
) -> list[torch.Tensor] | None:
    """Every group rank's `tensor` (same shape and dtype on all), in group order: on `dst` only
    (None elsewhere), or on every rank when dst is None, on `tensor`'s device (moved to the one
    the backend needs for the collective: a few bytes a record). A group of one: no collective."""
    if len(ranks) == 1:
        return [tensor]
    home, wire = tensor.device, transport_device(group)
    tensor = tensor.contiguous().to(wire)
    if dst is None:
        out = [torch.empty_like(tensor) for _ in ranks]
        dist.all_gather(out, tensor, group=group)
        return [t.to(home) for t in out]
    me = dist.get_rank()
    out = [torch.empty_like(tensor) for _ in ranks] if me == dst else None
    dist.gather(tensor, out, dst=dst, group=group)
    return None if out is None else [t.to(home) for t in out]


# ------------------------------------------------------------------ combining pieces across ranks


@dataclass
class DigestCounters:
    """What a rank's digests cost it (summed over calls; audit.Recorder keeps one): tensor bytes
    read to hash them, and bytes received from other ranks by the exchanges that combine pieces
    (`combine`), split by kind: the lanes rows of tensors above whole_bytes (5 int64 per tensor
    per sending rank) and the gathered pieces of tensors of at most whole_bytes."""

    hashed_bytes: int = 0  # bytes of tensor data this rank hashed (its own pieces, tensors gathered to it)
    received_bytes: int = 0  # all bytes received from other ranks by digest exchanges
    lattice_records: int = 0  # tensors above whole_bytes combined on this rank from the ranks' lanes
    lattice_received_bytes: int = 0  # the part of received_bytes that carried those lanes
    gathered_records: int = 0  # tensors of at most whole_bytes gathered whole to this rank
    gathered_received_bytes: int = 0  # the part of received_bytes that carried their pieces


@dataclass
class Combined:
    """What the ranks' pieces of one logical tensor add up to, on the rank(s) that receive it:
    the whole tensor (`full`: a tensor of at most `whole_bytes`, gathered) or the lanes of all its
    elements with, when asked, absmax and the sum from per-rank partial statistics."""

    full: torch.Tensor | None = None
    lanes: tuple[int, int] | None = None
    absmax: float | None = None
    total: float | None = None


def reduced(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor with Partial placements reduced (Replicate): its local pieces then hold the
    logical tensor's elements (a collective over the mesh when there is a Partial)."""
    if any(p.is_partial() for p in tensor.placements):
        from torch.distributed.tensor import Replicate

        placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
        tensor = tensor.redistribute(tensor.device_mesh, placements)
    return tensor


def _local_bytes(local: torch.Tensor) -> torch.Tensor:
    flat = local.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat


def _flat_index(piece: Piece) -> torch.Tensor:
    """Row-major flat global index of every element of `piece`, in the local row-major order."""
    flat = torch.zeros((), dtype=torch.int64)
    for d, idx in enumerate(piece.index):
        view = [1] * len(piece.index)
        view[d] = -1
        flat = flat + (idx * math.prod(piece.shape[d + 1 :])).view(view)
    return flat.expand(piece.local_shape).reshape(-1)


def _nan_max(values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else max(values)


_F64 = torch.float64


def _stats_row(tensor: torch.Tensor, with_stats: bool, partial_stats) -> list:
    """One rank's row for a large tensor: lanes, absmax and sum (float64 bits), elements hashed."""
    picked = _my_share(tensor)
    if picked is None:
        return [0, 0, 0, 0, 0]
    a, b = share_lanes(*picked)
    absmax = total = 0.0
    if with_stats:
        absmax, total = partial_stats(picked[0])
    bits = torch.tensor([absmax, total], dtype=_F64).view(torch.int64).tolist()
    return [_kernel.to_signed(a), _kernel.to_signed(b), *bits, picked[0].numel()]


def _combine_large(rows: list[torch.Tensor], k: int, with_stats: bool) -> Combined:
    """Rank rows (group order) of large tensor k -> lanes, and absmax / sum in rank order."""
    mine = [r[k] for r in rows if int(r[k, 4]) > 0]
    lane_pair = _kernel.add_lanes([(int(r[0]), int(r[1])) for r in mine])
    if not with_stats:
        return Combined(lanes=lane_pair)
    stats = [r[2:4].view(_F64).tolist() for r in mine]
    absmax = _nan_max([s[0] for s in stats]) if stats else math.nan
    total = -0.0
    for s in stats:  # the group's rank order: fixed for a layout
        total = total + s[1]
    return Combined(lanes=lane_pair, absmax=absmax, total=total)


def _my_share(tensor: torch.Tensor) -> tuple[torch.Tensor, Piece | int] | None:
    """The elements this rank hashes of a DTensor (its replica's share of its local piece), or
    of a plain tensor that every rank of the default group holds whole (DDP's replicated
    parameters: `combine`), as `share_lanes` takes it: (local elements, their piece or the global
    index of their first element); None when the share is empty."""
    if is_dtensor(tensor):
        return share_of(tensor.to_local(), piece_of(tensor), *replica(tensor))
    return replicated_share(tensor, dist.get_rank(), dist.get_world_size())


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


def combine(
    items: Sequence[tuple[torch.Tensor, bool, int | None]],
    *,
    whole_bytes: int,
    partial_stats,
    counters: DigestCounters | None = None,
) -> list[Combined | None]:
    """For each (DTensor, with_stats, dst): its Combined on rank `dst` (every rank when dst is
    None), None elsewhere. Collective: every rank of each tensor's mesh calls it with the same
    items in the same order. One gather per (process group, dst) of the lanes of the large
    tensors (5 int64 per tensor per rank), one of the pieces of the tensors of at most
    `whole_bytes` bytes (sent by the first of their replicas); a group without `dst` skips
    both. A plain tensor among the items is one that every rank of the default group holds
    whole (replicated, as under DDP), larger than `whole_bytes`: the ranks split its dim-0
    rows as a DTensor's replicas do. `partial_stats(local)` -> (absmax, sum) of a rank's share
    (as floats). `counters`: the bytes this rank hashes here (its shares of the large tensors)
    and receives are added to it (a small tensor gathered whole is hashed by the caller, which
    counts its bytes)."""
    tensors = [reduced(t) if is_dtensor(t) else t for t, _, _ in items]
    batches: dict[tuple[tuple[int, ...], int | None], list[int]] = {}
    groups: dict[tuple[int, ...], object | None] = {}
    for i, (t, (_, _, dst)) in enumerate(zip(tensors, items)):
        if is_dtensor(t):
            group, ranks = group_of(t.device_mesh)
        else:
            assert t.numel() * t.element_size() > whole_bytes, "a replicated plain tensor <= C is hashed by its writer"
            group, ranks = None, list(range(dist.get_world_size()))
        groups[tuple(ranks)] = group
        batches.setdefault((tuple(ranks), dst), []).append(i)
    out: list[Combined | None] = [None] * len(items)
    for (ranks, dst), batch in batches.items():
        if dst is not None and dst not in ranks:
            continue  # nobody here receives: no collective, no hashing
        group = groups[ranks]
        small = [i for i in batch if tensors[i].numel() * tensors[i].element_size() <= whole_bytes]
        large = [i for i in batch if tensors[i].numel() * tensors[i].element_size() > whole_bytes]
        if large:
            rows = []
            for i in large:
                rows.append(_stats_row(tensors[i], items[i][1], partial_stats))
            sent = torch.tensor(rows, dtype=torch.int64)
            gathered = gather(sent, group, ranks, dst)
            if gathered is not None:
                for k, i in enumerate(large):
                    out[i] = _combine_large(gathered, k, items[i][1])
            if counters is not None:
                counters.hashed_bytes += sum(row[4] * tensors[i].element_size() for row, i in zip(rows, large))
                if gathered is not None:
                    received = (len(ranks) - 1) * sent.nbytes
                    counters.lattice_records += len(large)
                    counters.lattice_received_bytes += received
                    counters.received_bytes += received
        if small:
            fulls, received = _gather_small([tensors[i] for i in small], group, ranks, dst)
            for i, full in zip(small, fulls):
                out[i] = None if full is None else Combined(full=full)
            if counters is not None and fulls[0] is not None:
                counters.gathered_records += len(small)
                counters.gathered_received_bytes += received
                counters.received_bytes += received
    return out


def _gather_small(
    tensors: list[torch.Tensor], group, ranks: Sequence[int], dst: int | None
) -> tuple[list[torch.Tensor | None], int]:
    """(the whole logical tensors of small DTensors on dst, or on all when dst is None, None
    elsewhere; the bytes this rank received): each first replica sends its piece's bytes; one
    gather of a buffer padded to the largest rank's total."""
    layout = []  # per tensor: per group rank, its piece (None: not the sender) and byte count
    for t in tensors:
        per_rank = []
        for r in ranks:
            coord = coordinate(t.device_mesh, r)
            piece = piece_of(t, coord) if replica(t, coord)[0] == 0 else None
            per_rank.append((piece, 0 if piece is None else piece.numel * t.element_size()))
        layout.append(per_rank)
    totals = [sum(per_rank[j][1] for per_rank in layout) for j in range(len(ranks))]
    me = ranks.index(dist.get_rank())
    buffer = torch.zeros(max(totals), dtype=torch.uint8)
    at = 0
    for t, per_rank in zip(tensors, layout):
        if per_rank[me][0] is not None and per_rank[me][1]:
            data = _local_bytes(t.to_local())
            buffer[at : at + len(data)] = data
            at += len(data)
    gathered = gather(buffer, group, ranks, dst)
    if gathered is None:
        return [None] * len(tensors), 0
    fulls = []
    offsets = [0] * len(ranks)
    for t, per_rank in zip(tensors, layout):
        size = t.element_size()
        full = torch.zeros(t.numel(), size, dtype=torch.uint8)
        for j, (piece, nbytes) in enumerate(per_rank):
            if piece is not None and nbytes:
                data = gathered[j][offsets[j] : offsets[j] + nbytes]
                full[_flat_index(piece)] = data.view(-1, size)
                offsets[j] += nbytes
        fulls.append(full.reshape(-1).view(t.dtype).reshape(t.shape))
    return fulls, (len(ranks) - 1) * buffer.nbytes


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
