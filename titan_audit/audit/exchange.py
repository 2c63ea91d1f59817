"""The few collectives that combine what ranks computed over their own pieces (audit/shards.py)
into a record's digest and statistics on the rank that writes it (audit/fingerprint.py defines
the digests; summary.py, recorder.py, by_piece.py and rl/weights.py use them).

Guarantees:
- `gather(...)`: one collective over a mesh's process group (the default group when the mesh
  spans every rank), to one rank or to all, of one fixed-size tensor per rank; every rank of
  the group must call it in the same order.
- `combine(items)`: what many DTensors' pieces add up to, on the rank that needs it: a tensor
  of more than `whole_bytes` as the sum of the ranks' lanes (and their partial absmax / sum),
  one of at most `whole_bytes` gathered whole; one gather per process group and destination for
  all the items, and none in a group the destination is not part of. A plain tensor that every
  rank holds whole (DDP) is combined like a DTensor replicated over the default group: each
  rank hashes its share of the dim-0 rows, so the work is split W ways
  (`shards.replicated_share`). With `counters` (`DigestCounters`) it adds the tensor bytes this
  rank hashed and the bytes it received from the other ranks (a few integer additions per call).
- On GPU ranks no record waits for its device: a share's lanes and partial statistics stay on
  the device that computed them (`shards.share_sums`, the caller's `partial_stats`), the rows
  are stacked there and gathered on the device the backend moves (NCCL: the rank's GPU), and
  the pieces of the tensors of at most `whole_bytes` are copied into the gathered buffer there.
  The receiving rank reads each gathered result to the host once: one wait for the device per
  process group and destination, for the lanes and for the small tensors, not one per tensor.
  The other ranks wait for nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_audit.audit.pieces import Piece, coordinate, is_dtensor, piece_of, replica, share_of
from titan_audit.audit.shards import replicated_share, share_sums
from titan_audit.batch_invariant.cpu import lattice as _kernel


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
    """A piece's bytes in row-major order, on its own device."""
    flat = local.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: a host tensor through pinned memory without blocking; a device's
    tensor to the host waits for that device."""
    if tensor.device == device:
        return tensor
    return _kernel.sent_to(tensor, device) if tensor.is_cpu else tensor.to(device)


def stacked(rows: Sequence[torch.Tensor], group: object | None, ranks: Sequence[int]) -> torch.Tensor:
    """The rows (one shape and dtype) as one tensor on the device `gather` moves for the group
    (a group of one: the first row's), a host row sent there without blocking."""
    wire = rows[0].device if len(ranks) == 1 else transport_device(group)
    return torch.stack([_on(row, wire) for row in rows])


def read(gathered: list[torch.Tensor]) -> list[torch.Tensor]:
    """`gather`'s tensors on the host: one copy (one wait) when they are on a device."""
    if gathered[0].is_cpu:
        return gathered
    return list(torch.stack(gathered).cpu().unbind(0))


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
PartialStats = Callable[[torch.Tensor], torch.Tensor]  # a share -> float64 [absmax, sum], where it was hashed


def _lanes_row(tensor: torch.Tensor, with_stats: bool, partial_stats: PartialStats | None) -> tuple[torch.Tensor, int]:
    """(this rank's row for a large tensor: int64 [5] = its share's two lanes, absmax and sum as
    float64 bits, elements hashed, on the device that hashed the share (not read) or the host;
    the elements hashed)."""
    picked = _my_share(tensor)
    if picked is None:
        return torch.zeros(5, dtype=torch.int64), 0
    local, where = picked
    sums = share_sums(local, where)
    device = sums.device
    if with_stats:
        stats = _on(partial_stats(local), device)
    else:
        stats = torch.zeros(2, dtype=_F64, device=device)
    count = torch.full((1,), local.numel(), dtype=torch.int64, device=device)
    return torch.cat([sums, stats.view(torch.int64), count]), local.numel()


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
    parameters: `combine`), as `shards.share_sums` takes it: (local elements, their piece or the global
    index of their first element); None when the share is empty."""
    if is_dtensor(tensor):
        return share_of(tensor.to_local(), piece_of(tensor), *replica(tensor))
    return replicated_share(tensor, dist.get_rank(), dist.get_world_size())


def combine(
    items: Sequence[tuple[torch.Tensor, bool, int | None]],
    *,
    whole_bytes: int,
    partial_stats: PartialStats | None,
    counters: DigestCounters | None = None,
) -> list[Combined | None]:
    """For each (DTensor, with_stats, dst): its Combined on rank `dst` (every rank when dst is
    None), None elsewhere. Collective: every rank of each tensor's mesh calls it with the same
    items in the same order. One gather per (process group, dst) of the lanes of the large
    tensors (5 int64 per tensor per rank), one of the pieces of the tensors of at most
    `whole_bytes` bytes (sent by the first of their replicas); a group without `dst` skips
    both. A plain tensor among the items is one that every rank of the default group holds
    whole (replicated, as under DDP), larger than `whole_bytes`: the ranks split its dim-0
    rows as a DTensor's replicas do. `partial_stats(local)` -> float64 [absmax, sum] of a rank's
    share, on the device that computed them (not read: module doc); None when no item asks for
    statistics. `counters`: the bytes this rank hashes here (its shares of the large tensors)
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
            rows, counts = zip(*(_lanes_row(tensors[i], items[i][1], partial_stats) for i in large))
            sent = stacked(rows, group, ranks)
            gathered = gather(sent, group, ranks, dst)
            if gathered is not None:
                gathered = read(gathered)
                for k, i in enumerate(large):
                    out[i] = _combine_large(gathered, k, items[i][1])
            if counters is not None:
                counters.hashed_bytes += sum(n * tensors[i].element_size() for n, i in zip(counts, large))
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
    wire = tensors[0].device if len(ranks) == 1 else transport_device(group)
    buffer = torch.zeros(max(totals), dtype=torch.uint8, device=wire)
    at = 0
    for t, per_rank in zip(tensors, layout):
        if per_rank[me][0] is not None and per_rank[me][1]:
            data = _local_bytes(t.to_local())
            buffer[at : at + len(data)] = data
            at += len(data)
    gathered = gather(buffer, group, ranks, dst)
    if gathered is None:
        return [None] * len(tensors), 0
    gathered = read(gathered)
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
