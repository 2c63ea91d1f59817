"""Where a rank's elements of a logical tensor are: `Piece` and the DTensor placements behind it.

Guarantees:
- `Piece`: the elements a local tensor holds, per dimension the ascending global indices of its
  positions along it. `piece_of(dtensor)` follows the DTensor's placements as DTensor does
  (torch.chunk sizes for `Shard`, uneven included, `_StridedShard`'s strided sets, several mesh
  dimensions on one tensor dimension in mesh order); a plain tensor is one whole piece.
- `replica(dtensor)`: this rank's share of its piece when a mesh dimension replicates it
  (`Replicate`): the k ranks holding one piece hash dim-0 row ranges [p*R/k, (p+1)*R/k) each
  (`share`, `share_of`).
Nothing here communicates: a piece follows from the placements and the mesh coordinate alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Per dimension, the global indices (int64, ascending) of a local tensor's positions."""

    shape: tuple[int, ...]
    index: tuple[torch.Tensor, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Piece:
        return cls(tuple(shape), tuple(torch.arange(n) for n in shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(len(i) for i in self.index)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def rows(self, lo: int, hi: int) -> Piece:
        """The sub-piece of local dim-0 positions [lo, hi) (of a piece with at least one dim)."""
        assert self.index, "a 0-d piece has no rows"
        return Piece(self.shape, (self.index[0][lo:hi], *self.index[1:]))

    def runs(self) -> list[list[list[int]]]:
        """Per dimension, the index set as [start, stop) runs (JSON: a checkpoint's metadata)."""
        out = []
        for idx in self.index:
            if not len(idx):
                out.append([])
                continue
            breaks = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
            starts, stops = [0, *breaks], [*breaks, len(idx)]
            out.append([[int(idx[a]), int(idx[b - 1]) + 1] for a, b in zip(starts, stops)])
        return out

    @classmethod
    def from_runs(cls, shape: Sequence[int], runs: Sequence[Sequence[Sequence[int]]]) -> Piece:
        if len(runs) != len(shape):
            raise ValueError(f"a piece of a {len(shape)}-d tensor needs {len(shape)} index runs, got {len(runs)}")
        index = []
        for n, dim_runs in zip(shape, runs):
            parts = [torch.arange(int(a), int(b)) for a, b in dim_runs]
            idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
            if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise ValueError(f"piece runs {list(dim_runs)} out of range for a dimension of size {n}")
            index.append(idx)
        return cls(tuple(shape), tuple(index))

    def positions_in(self, other: Piece) -> tuple[torch.Tensor, ...]:
        """Per dimension, the local positions of this piece whose global index `other` holds."""
        return tuple(torch.nonzero(torch.isin(a, b)).flatten() for a, b in zip(self.index, other.index))


def is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


_COORDINATES: dict[tuple, list[int]] = {}


def coordinate(mesh, rank: int) -> list[int]:
    """The coordinate of global `rank` in `mesh` (ValueError when it is not in the mesh)."""
    found = _COORDINATES.get((mesh, rank))
    if found is None:
        hits = torch.nonzero(mesh.mesh == rank)
        if not len(hits):
            raise ValueError(f"rank {rank} is not in the device mesh {mesh.mesh.tolist()}")
        found = _COORDINATES.setdefault((mesh, rank), hits[0].tolist())
    return found


_PIECES: dict[tuple, Piece] = {}  # (shape, placements, mesh, coordinate) -> Piece: a step asks again


def piece_of(tensor: torch.Tensor, coord: Sequence[int] | None = None) -> Piece:
    """The piece a DTensor's local tensor holds on this rank (or at mesh coordinate `coord`); a
    plain tensor's whole piece."""
    if not is_dtensor(tensor):
        return Piece.whole(tensor.shape)
    mesh = tensor.device_mesh
    if coord is None:
        coord = mesh.get_coordinate()
        assert coord is not None, "piece_of: this rank is not in the DTensor's mesh"
    key = (tuple(tensor.shape), tuple(tensor.placements), mesh, tuple(coord))
    piece = _PIECES.get(key)
    if piece is None:
        piece = _placed(tensor, mesh, coord)
        if len(_PIECES) < 65536:
            _PIECES[key] = piece
    return piece


def _placed(tensor: torch.Tensor, mesh, coord: Sequence[int]) -> Piece:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    index = [torch.arange(n) for n in tensor.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, _StridedShard):
            _, offsets = placement.local_shard_size_and_offset(
                len(index[placement.dim]), mesh.size(mesh_dim), coord[mesh_dim], _StridedShardOffsetMode.ALL
            )
            index[placement.dim] = index[placement.dim][torch.tensor(offsets, dtype=torch.int64)]
        elif isinstance(placement, Shard):
            dim = placement.dim
            size, offset = Shard.local_shard_size_and_offset(len(index[dim]), mesh.size(mesh_dim), coord[mesh_dim])
            index[dim] = index[dim][offset : offset + size]
        elif not placement.is_replicate():
            raise ValueError(f"piece_of: placement {placement} holds no elements of the logical tensor (reduce it)")
    # A Shard slice is a view of its dimension's whole arange; the cached piece keeps only the
    # local positions (a rank's pieces cost ~ the sum of its local dims, not of the global ones).
    return Piece(tuple(tensor.shape), tuple(i.clone() if i.untyped_storage().nbytes() > i.nbytes else i for i in index))


def replica(tensor: torch.Tensor, coord: Sequence[int] | None = None) -> tuple[int, int]:
    """(p, k): k ranks hold this rank's piece (the mesh's Replicate dimensions), this is the p-th."""
    if not is_dtensor(tensor):
        return 0, 1
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate() if coord is None else coord
    part, parts = 0, 1
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            part = part * mesh.size(mesh_dim) + coord[mesh_dim]
            parts *= mesh.size(mesh_dim)
    return part, parts


def share(piece: Piece, part: int, parts: int) -> tuple[int, int]:
    """Local dim-0 positions [lo, hi) that share `part` of `parts` of `piece` covers (a 0-d
    piece counts as one row)."""
    return share_rows(piece.local_shape[0] if piece.index else 1, part, parts)


def share_rows(rows: int, part: int, parts: int) -> tuple[int, int]:
    """Rows [lo, hi) of `rows` that share `part` of `parts` covers: the one split rule."""
    return rows * part // parts, rows * (part + 1) // parts


def share_of(local: torch.Tensor, piece: Piece, part: int, parts: int) -> tuple[torch.Tensor, Piece] | None:
    """(local rows, their piece) of share `part` of `parts` (module doc); None when it is empty."""
    lo, hi = share(piece, part, parts)
    if hi <= lo:
        return None
    if not piece.index:
        return local, piece
    return local[lo:hi], piece.rows(lo, hi)
