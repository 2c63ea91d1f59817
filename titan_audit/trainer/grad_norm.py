"""The global gradient norm for clipping, computed where the gradient lives.

Order "v2" (`determinism.grad_norm`, the default). Every parameter's gradient is read as rows
[R, K] (dim 0 by the rest flattened; a 1-D tensor is [n, 1]). A row's sum of squares is the
blocked tree of the v2 gemm order (batch_invariant/order.py): P(K) blocks of K/P columns, each
block by the batch-invariant row sum of squares, the P block sums combined by the halving tree.
The rows of all parameters, in parameter order, make one vector; its batch-invariant sum is the
squared norm, and the norm its correctly rounded sqrt. Every piece is a function of one row's
elements, so a rank computes the rows it holds:
- data parallel: every row, locally;
- FSDP2: the rows of its dim-0 shards; an all-gather over dp moves the row values (R floats per
  parameter, not R*K);
- tensor parallel: a Shard(0) piece holds whole rows; a Shard(1) piece of t holds P/t whole blocks
  of every row, and its halving-tree partial is a node of the row's tree (t divides P(K), which
  trainer/tensor_parallel.py checks for every sharded linear), so the t partials combined by the
  same tree are the row's value; replicated parameters are counted once.
Hence the same bits for every W, DP or FSDP2, and every tensor-parallel layout the trainer accepts,
with only row values exchanged. The kernels are the batch-invariant backend's in every mode (the
norm is portable even where the step runs native ops).

Order "v1" (runs recorded before v2; a saved config without the key reads as "v1"): one
`torch.linalg.vector_norm` over the whole flat gradient in parameter order, which needs the full
gradient on every rank (gathered under FSDP2 and tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.order import tree_blocks, tree_combine
from titan_audit.trainer.reduce import all_gather_single


@dataclass(frozen=True)
class Piece:
    """What a rank holds of one parameter's gradient: `local` (this rank's tensor), the rows of the
    tensor the dp shards cut (`rows`: FSDP2's unsharded, i.e. TP-local, dim 0; None when not
    sharded over dp), the tensor-parallel placement (`tp_dim`: 0, 1 or None = replicated) and the
    parameter's full dim 0 (`full_rows`, what a Shard(0) over tp cuts)."""

    local: torch.Tensor
    rows: int | None = None
    tp_dim: int | None = None
    full_rows: int = 0


def _row_sums(local: torch.Tensor, k_full: int, shards: int) -> torch.Tensor:
    """[R] halving-tree partials over this piece's blocks of every row (all of them when shards == 1)."""
    rows = local.shape[0] if local.dim() else 1
    if rows == 0:  # an empty FSDP2 shard (more ranks than rows)
        return torch.zeros(0, dtype=torch.float32, device=local.device)
    blocks = tree_blocks(k_full)
    if blocks % shards:
        raise ValueError(
            f"gradient norm: {shards} tensor-parallel shards do not divide the {blocks} blocks of a row of {k_full}"
        )
    x = local.reshape(rows, blocks // shards, k_full // blocks).float()
    be = backend_for(x)
    if hasattr(be, "sum_squares_dims"):
        sums = be.sum_squares_dims(x, [2], False)
    else:
        sums = be.sum_dims(x * x, [2], False)
    return tree_combine(list(sums.unbind(1)))


def _gather_rows(values: list[torch.Tensor], sizes: list[list[int]], group) -> list[list[torch.Tensor]]:
    """Every rank's `values` (one vector per parameter, rank q's of length sizes[p][q]) from all
    ranks of `group`: out[p][q]. One all-gather of fixed-size segments (max over ranks)."""
    world = len(sizes[0]) if sizes else 1
    widths = [max(s) for s in sizes]
    send = torch.zeros(sum(widths), dtype=torch.float32, device=values[0].device if values else "cpu")
    offset = 0
    for v, width in zip(values, widths, strict=True):
        send[offset : offset + v.numel()] = v
        offset += width
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    all_gather_single(out, send, group=group)
    out = out.view(world, -1)
    result, offset = [], 0
    for size, width in zip(sizes, widths, strict=True):
        result.append([out[q, offset : offset + size[q]] for q in range(world)])
        offset += width
    return result


def chunk_sizes(n: int, world: int) -> list[int]:
    """torch.chunk's sizes of n rows over `world` (FSDP2 and DTensor's Shard): ceil-sized, empty tail."""
    c = -(-n // world) if n else 0
    return [max(0, min((q + 1) * c, n) - q * c) for q in range(world)]


def norm_v2(pieces: list[Piece], *, dp_group=None, dp: int = 1, tp_group=None, tp: int = 1) -> torch.Tensor:
    """The squared-norm-of-rows order above, then sqrt. Collective over dp (when pieces are dp
    shards) and tp (when any piece is tensor-parallel)."""
    partial = []
    for piece in pieces:
        local = piece.local
        k_local = torch.Size(local.shape[1:]).numel() if local.dim() else 1
        shards = tp if piece.tp_dim == 1 else 1
        partial.append(_row_sums(local, k_local * shards, shards))
    if dp > 1 and any(p.rows is not None for p in pieces):  # FSDP2: every dp shard's rows
        sizes = [chunk_sizes(p.rows, dp) if p.rows is not None else [v.numel()] * dp for p, v in zip(pieces, partial)]
        gathered = _gather_rows(partial, sizes, dp_group)
        partial = [torch.cat(g) if p.rows is not None else v for p, g, v in zip(pieces, gathered, partial)]
    if tp > 1 and any(p.tp_dim is not None for p in pieces):
        sizes = [
            chunk_sizes(p.full_rows, tp) if p.tp_dim == 0 else [v.numel() if p.tp_dim == 1 else 0] * tp
            for p, v in zip(pieces, partial)
        ]
        sent = [v if p.tp_dim is not None else v[:0] for p, v in zip(pieces, partial)]
        gathered = _gather_rows(sent, sizes, tp_group)
        for i, piece in enumerate(pieces):
            if piece.tp_dim == 0:
                partial[i] = torch.cat(gathered[i])
            elif piece.tp_dim == 1:
                partial[i] = tree_combine(gathered[i])
    rows = torch.cat([v.reshape(-1) for v in partial])
    total = backend_for(rows).sum_dims(rows, [0], False)
    return total.sqrt()


def tp_dim(param: torch.Tensor) -> int | None:
    """The dim a tensor-parallel placement shards (None: replicated over tp, or no TP): the
    placement on the mesh dimension named "tp" (trainer/mesh.py's Mesh)."""
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    placement = param.placements[names.index("tp")]
    if isinstance(placement, Replicate):
        return None
    assert isinstance(placement, Shard), placement
    return placement.dim


def full_norm_v1(flat_full: torch.Tensor) -> torch.Tensor:
    """Order v1: the norm of the whole flat gradient (every rank holds it)."""
    return torch.linalg.vector_norm(flat_full, 2.0)
