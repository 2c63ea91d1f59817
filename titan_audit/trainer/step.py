"""The part of a step both loops share, from the learning rate to the audited update (`StepKit`).

Guarantees: each microbatch's fp32 gradient lands in a buffer from a pool (`GradBuffers`: none
allocated after the first step) and the fixed-tree reduction (reduce.py; FSDP2: fsdp.py's sharded
tree) sums the V microbatch gradients with the same bits on every rank and at every W; clipping
uses a norm with the same bits at every layout (grad_norm.py); then the optimizer step and the
step's audit records. With `determinism.enabled = false` it is a conventional trainer (.grad
accumulated, one plain all_reduce or FSDP2's reduce-scatter): the negative control.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_audit.trainer import grad_norm as norms
from titan_audit.trainer.optim import lr_at, set_lr
from titan_audit.trainer.reduce import TreeReducer, gather_in_index_order

if TYPE_CHECKING:
    from titan_audit.trainer.run import Run


def set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's .grad becomes its slice of `flat` (a view, cast to the parameter's dtype);
    a tensor-parallel (DTensor) parameter's local shard is its slice, wrapped in its placement."""
    offset = 0
    for p in params:
        local = local_shape(p)
        n = local.numel()
        grad = flat[offset : offset + n].view(local).to(p.dtype)
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False) if is_dtensor(p) else grad
        offset += n
    assert offset == flat.numel(), (offset, flat.numel())


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's .grad (zeros where None; a DTensor's local shard) as one fresh fp32
    vector, in parameter order."""
    parts = []
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros(local_shape(p), dtype=p.dtype, device=p.device)
        parts.append((grad.to_local() if is_dtensor(grad) else grad).reshape(-1).float())
    return torch.cat(parts)


def clip_(flat: torch.Tensor, max_norm: float, full: torch.Tensor | None = None) -> torch.Tensor:
    """Scale `flat` in place to global norm <= max_norm (0: no clipping); returns the norm before.
    The norm is that of the full reduced gradient (`flat` itself, or under tensor parallelism
    `full`: every shard gathered, in the TP=1 order), identical on every rank, so every rank clips
    alike."""
    norm = torch.linalg.vector_norm(flat if full is None else full, 2.0)
    if max_norm > 0:
        flat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class GradBuffers:
    """A pool of flat fp32 gradient buffers of `numel` elements on the parameters' device.

    `take` lends a zeroed buffer, a free one if there is one, else a new one; `give` takes it back
    (it must be one this pool lent and has not had back). Buffers are never freed, so once a step
    has run, the same steps allocate nothing (fresh 16 MB allocations per microbatch cost page
    faults). A microbatch's gradient is 0 + autograd's gradient, accumulated in place through .grad
    views: the same bits for every W and whichever buffer it lands in. `allocated` counts the
    buffers made, `peak` the most lent at once."""

    def __init__(self, numel: int, device: torch.device | str = "cpu") -> None:
        self.numel, self.device = numel, torch.device(device)
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # id -> buffer, while lent
        self.allocated = 0
        self.peak = 0

    @property
    def lent(self) -> int:
        """How many buffers are out now."""
        return len(self._lent)

    def take(self) -> torch.Tensor:
        if self._free:
            buffer = self._free.pop()  # the last one given back: the likeliest still in cache
        else:
            buffer = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self.allocated += 1
        assert id(buffer) not in self._lent
        self._lent[id(buffer)] = buffer
        self.peak = max(self.peak, len(self._lent))
        return buffer.zero_()

    def give(self, buffer: torch.Tensor) -> None:
        assert self._lent.pop(id(buffer), None) is buffer, "given back a buffer this pool has not lent"
        self._free.append(buffer)


class StepKit:
    """The part of a step both loops share, from the learning rate to the audited update.

    Deterministic (always for rl), data parallel: each microbatch's gradient lands in a zeroed
    buffer from the pool (`buffers`), which goes into the TreeReducer under the microbatch's GLOBAL
    index; the reducer gives each buffer back once it is spent (added into its left sibling, or
    sent). `finish` reduces by the fixed tree, clips, gives each parameter its slice (views of the
    reduced buffer, valid until the next step's first microbatch) and steps the optimizer; then the
    reduced buffer goes back too, so every buffer is in the pool between steps. Memory per rank:
    the pool lends at most floor(log2(V/W)) + 1 gradient-sized buffers at once when V/W is a power
    of two (for any W, 3 included; otherwise at most 2*floor(log2(V/W)) + 1, e.g. 3 at V = 6,
    W = 2), all allocated in the first step. With the exchange's receive scratch on gloo (under one
    gradient), that is at most floor(log2(V/W)) + 2 gradient-sized buffers per rank; gradients up
    to COLLECTIVE_MAX_BYTES also keep a send buffer, and on one host the shared file replaces both
    (reduce.py).
    Deterministic FSDP2 (`sharded`, a trainer/fsdp.py ShardedTree): rank r runs the microbatches
    k*W + r (`interleaved`); FSDP's reduce-scatter step feeds each group's pieces to the group's
    tree of shard partials during the backward, and `finish` gives each parameter its reduced
    shard: memory per rank ~ (floor(log2(V/W)) + 1) x P/W for gradients, never a full one.
    The clip norm (trainer/grad_norm.py, `determinism.grad_norm`): order v2 from the rows each rank
    holds, only row values exchanged; order v1 over the full flat gradient (gathered where sharded).
    Conventional (`determinism.enabled = false`): .grad accumulates, one plain all_reduce (FSDP2:
    its own reduce-scatter, rescaled to the sum)."""

    def __init__(self, run: Run, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, sharded=None):
        self.run, self.params, self.optimizer, self.sharded = run, params, optimizer, sharded
        self.config = run.config
        self.deterministic = bool(run.config.determinism.enabled)
        self.norm_order = getattr(run.config.determinism, "grad_norm", "v2")
        self.interleaved = self.deterministic and sharded is not None
        group = run.mesh.dp_group  # TP ranks of a dp rank hold the same microbatches: the tree is over dp
        pooled = self.deterministic and not sharded
        self.buffers = GradBuffers(sum(local_shape(p).numel() for p in params) if pooled else 0, run.mesh.device)
        self.reducer = TreeReducer(run.config.num_microbatches, group, self.buffers.give) if pooled else None
        self.tensor_parallel = run.mesh.tp > 1
        self._leaf: torch.Tensor | None = None
        self._reduced: torch.Tensor | None = None  # the pool's buffer holding this step's reduced gradient

    def start(self, step: int) -> float:
        """Open the step's audit records and set its learning rate (returned)."""
        assert self.run.recorder is not None, "run.begin() before the first step"
        self.run.recorder.start_step(step)
        lr = lr_at(step - 1, self.config.optimizer, self.config.schedule, self.config.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        if self.interleaved:
            self.sharded.start_step(self.config.num_microbatches)
        return lr

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """This rank's next microbatch, global index `index`: its records and its gradient (the
        block's backward) go under `index`; deterministic: the gradient goes into the tree there."""
        if self.reducer is not None:
            self._leaf = self.buffers.take()  # autograd accumulates 0 + g into views of it
            set_grads(self.params, self._leaf)
        self.run.recorder.set_microbatch(index)
        yield
        if self.reducer is not None:
            self.reducer.add(index, self._leaf)
        if self.interleaved:
            self.sharded.end_backward()
        if self.deterministic:  # FSDP2: what FSDP wrote into .grad is not the tree's; drop it
            self.optimizer.zero_grad(set_to_none=True)

    def gather_in_index_order(self, local: torch.Tensor) -> torch.Tensor:
        """Every dp rank's rows of `local` (one per local microbatch) in microbatch index order."""
        dp = self.run.mesh.dp
        out = gather_in_index_order(local, dp, self.run.mesh.dp_group)
        if self.interleaved and dp > 1:  # rank r's j-th row is microbatch j*W + r
            out = out.view(dp, -1, *out.shape[1:]).transpose(0, 1).reshape(out.shape)
        return out

    def finish(self) -> float:
        """The step's gradient, clipping, optimizer step and their audit records; the grad norm."""
        recorder = self.run.recorder
        recorder.set_microbatch(-1)
        grad_norm = self._reduce_and_clip()
        recorder.record_grads()
        self.optimizer.step()
        recorder.record_optimizer(self.optimizer)
        recorder.record_params()
        if self._reduced is not None:  # the optimizer and the records are done with it
            self.buffers.give(self._reduced)
            self._reduced = None
        assert self.buffers.lent == 0, f"{self.buffers.lent} gradient buffers still lent after the step"
        return float(grad_norm)

    def _reduce_and_clip(self) -> torch.Tensor:
        max_norm = self.config.optimizer.grad_clip
        if self.interleaved:  # FSDP2: each rank's reduced shards, clipped by the norm from its rows
            self.sharded.finish()
            grads = [p.grad.to_local() for p in self.params]
            return _clip_pieces(grads, max_norm, self._norm(grads))
        if self.deterministic:  # the fixed tree; in BI mode the norm by the tree sum and our sqrt
            grad = self._reduced = self.reducer.all_reduce()
            grad_norm = _clip_pieces([grad], max_norm, self._norm(_local_views(self.params, grad), flat=grad))
            set_grads(self.params, grad)
            return grad_norm
        world_size = self.run.mesh.world_size
        if getattr(self.config.parallel, "mode", "dp") == "fsdp":
            # conventional FSDP2: its reduce-scatters averaged into the shards; want the sum
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(world_size)
            return _full(torch.nn.utils.clip_grad_norm_(self.params, max_norm or float("inf")))
        grad = flat_grad(self.params)
        if self.run.mesh.dp > 1:
            dist.all_reduce(grad, group=self.run.mesh.dp_group)
        grad_norm = clip_(grad, max_norm, full_flat(self.params, grad) if self.tensor_parallel else None)
        set_grads(self.params, grad)
        return grad_norm

    def _norm(self, grads: list[torch.Tensor], flat: torch.Tensor | None = None) -> torch.Tensor:
        """The global gradient norm (grad_norm.py) of these local gradients, one per parameter."""
        mesh = self.run.mesh
        if self.norm_order == "v1":
            if self.interleaved:  # every shard gathered: the old order needs the whole vector
                return norms.full_norm_v1(torch.cat([_full(p.grad).reshape(-1) for p in self.params]))
            return norms.full_norm_v1(full_flat(self.params, flat) if self.tensor_parallel else flat)
        pieces = [
            norms.Piece(
                g,
                rows=_unsharded_rows(p) if self.interleaved else None,
                tp_dim=norms.tp_dim(p),
                full_rows=p.shape[0] if p.dim() else 1,
            )
            for p, g in zip(self.params, grads, strict=True)
        ]
        tp_group = mesh.tp_mesh.get_group() if self.tensor_parallel else None
        dp = mesh.dp if self.interleaved else 1
        return norms.norm_v2(pieces, dp_group=mesh.dp_group, dp=dp, tp_group=tp_group, tp=mesh.tp)


def _clip_pieces(pieces: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Scale every piece in place so the global norm is <= max_norm (0: no clipping); elementwise,
    so each element gets the bits it gets in any other layout. Returns the norm before."""
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for piece in pieces:
            piece.mul_(scale)
    return norm


def _unsharded_rows(p: torch.Tensor) -> int:
    """The dim 0 FSDP2 shards over dp: the TP-local tensor's (a Shard(0) over tp cuts it first)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    if norms.tp_dim(p) == 0:
        mesh = p.device_mesh
        tp, rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
        rows = norms.chunk_sizes(rows, tp)[rank]
    return rows


def _local_views(params: list[torch.nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's local gradient as a view of `flat` (set_grads' layout)."""
    out, offset = [], 0
    for p in params:
        local = local_shape(p)
        out.append(flat[offset : offset + local.numel()].view(local))
        offset += local.numel()
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local_shape(p: torch.Tensor) -> torch.Size:
    """The shape this rank holds of `p` (a DTensor's local shard; else p's own)."""
    return p.to_local().shape if is_dtensor(p) else p.shape


def full_flat(params: list[torch.nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
    """The full gradient vector in the TP=1 order from this rank's `flat` of local shards: every
    tensor-parallel parameter's slice gathered to its full tensor (collective over its mesh)."""
    parts, offset = [], 0
    for p in params:
        local = local_shape(p)
        piece = flat[offset : offset + local.numel()]
        offset += local.numel()
        if is_dtensor(p):
            piece = DTensor.from_local(piece.view(local), p.device_mesh, p.placements, run_check=False)
            piece = piece.full_tensor().reshape(-1)
        parts.append(piece)
    return torch.cat(parts)
