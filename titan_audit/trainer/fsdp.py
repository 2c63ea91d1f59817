"""FSDP2 (`fully_shard`) with the deterministic gradient reduction as FSDP's own reduce-scatter step.

    tree = shard_model(model, deterministic=True)   # every block, then the root
    tree.start_step(V)
    for each of this rank's microbatches k*W + r:   # round k; interleaved (data/plan.py)
        loss.backward()                             # FSDP hands each group's packed gradient to the tree
        optimizer.zero_grad(set_to_none=True)
    tree.finish()                                   # each parameter's .grad = this rank's reduced shard

Guarantees:
- Parameters are sharded on dim 0 over the default group (FSDP2's layout), or with `mesh` over the
  dp dimension of a (dp, tp) mesh, composed with tensor parallelism (FSDP's "unsharded" parameter
  is then the local TP shard). Forward and backward run on all-gathered (bit-exact) parameters
  with the same ops as replicated data parallel, so a microbatch's unsharded gradient has the bits
  it has in DP.
- The reduced shard has the bits of the canonical tree over the V microbatch indices
  (trainer/reduce.py), i.e. of the DP run at any W. Rank r of W runs the microbatches k*W + r.
  In round k FSDP hands each parameter group's gradient, packed rank-major by dim-0 shard
  (`set_custom_reduce_scatter`), to `_Exchange`, which moves the pieces without adding them (one
  all_to_all_single): rank q receives shard q of the leaves k*W .. k*W + W - 1, in index order.
  The pieces are pushed onto the group's `TreeStack` as they are: the leaves arrive in index
  order, so the stack merges siblings as soon as both are there and holds the maximal nodes so
  far. In DP a leaf is 0 + g (autograd accumulates into zeros), so a -0.0 leaf is +0.0 there; a
  sum of raw leaves differs from the sum of normalised ones only where every leaf under it is
  -0.0 (-0.0 + -0.0 = -0.0, +0.0 + +0.0 = +0.0; -0.0 + x = +0.0 + x for every other x), so
  the root gets the same `0 +` once, over the shard, instead of every leaf.
  FSDP's AVG op is ignored (fp32 and bf16 reduce dtypes have no pre/post division), and what it
  writes into the sharded .grad is dropped by the caller's zero_grad after each backward.
  At W = 1 FSDP calls no reduce-scatter (it copies); the all-reduce hook then gets the copy.
- The exchange overlaps the backward: it runs asynchronously and completes (wait, push) when the
  next group's exchange starts or the microbatch's backward ends (`_InFlight`); the stacks see
  the same pushes in the same order.
- Memory per rank: W a power of two makes each round one subtree, so a group's stack holds at most
  floor(log2(V/W)) + 1 shard-sized partials (recycled between steps), plus, while one group
  reduces, its packed gradient and the received pieces (one layer's unsharded gradient each), and
  the previous group's, still in flight, while the next one packs.
  Any other W (3, 6, ...) works with the same bits and a deeper stack (at most the canonical
  tree's depth + 1 partials, e.g. V = 6, W = 3: 2).
- bf16 compute (`param_dtype`): the unsharded gradient is bf16; FSDP packs it into the fp32
  reduce dtype (an exact widening), the bits `take_flat`-style widening gave; shards, reduced
  gradients and AdamW state stay fp32.
This relies on FSDP2's reduce-scatter hook contract of torch 2.13 (`ReduceScatter.__call__`,
`set_all_reduce_hook`, `set_reduce_scatter_unused_params`, `FSDPParam.sharded_size` /
`contiguous_sharded_stride` / `to_sharded_dtensor`); the tests check it on this torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.cpu.matmul import disable_packed_cache
from titan_audit.trainer.reduce import TreeStack


@dataclass
class _Group:
    """One FSDP parameter group: its parameters in packing order, the tree stack of this rank's
    shard partials for the current step, and the shard-sized buffers it recycles."""

    name: str
    fsdp_params: list
    world_size: int
    stack: TreeStack | None = None
    rounds: int = 0
    free: list[torch.Tensor] = field(default_factory=list)
    lent: list[torch.Tensor] = field(default_factory=list)
    peak: int = 0  # the most shard-sized partials lent at once

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        buf = self.free.pop() if self.free else torch.empty_like(like)
        self.lent.append(buf)
        self.peak = max(self.peak, len(self.lent))
        return buf

    def give(self, buf: torch.Tensor) -> None:
        if any(buf is b for b in self.lent):
            self.lent = [b for b in self.lent if b is not buf]
            self.free.append(buf)

    def root(self) -> torch.Tensor:
        """The step's reduced shard: the tree's root, + 0.0 (the leaves' 0 + g, once: module doc)."""
        nodes = self.stack.take() if self.stack is not None else []
        if len(nodes) != 1 or nodes[0][:2] != (0, self.stack.num_leaves):
            raise RuntimeError(
                f"FSDP group {self.name}: the gradient tree is incomplete after {self.rounds} rounds "
                f"({[(lo, hi) for lo, hi, _ in nodes]}); every rank must run all its microbatches"
            )
        return nodes[0][2].add_(0.0)

    def push_round(self, pieces: torch.Tensor) -> None:
        """Round `rounds`: pieces [W, S] are this rank's shards of the leaves rounds*W .. +W-1."""
        assert self.stack is not None, "start_step() before the backward"
        for piece in pieces:
            self.stack.push(piece)
        # Partials still on the stack that live in this round's buffer move to recycled buffers
        # (a right sibling already went into its left one, which owns its buffer).
        storage = pieces.untyped_storage().data_ptr()
        for i, (lo, hi, value) in enumerate(self.stack.nodes):
            if value.untyped_storage().data_ptr() == storage:
                self.stack.nodes[i] = (lo, hi, self.buffer(value).copy_(value))
        self.rounds += 1


class _InFlight:
    """At most one exchange in flight per rank: started by a group's reduce-scatter step, it
    completes (wait, then the push onto that group's stack) when the next group's step starts or
    the microbatch's backward is over, so the move overlaps the backward of the layer before."""

    def __init__(self) -> None:
        self.pending: tuple | None = None  # (work, group, received, sent)

    def start(self, sent: torch.Tensor, pg, group: _Group) -> None:
        self.complete()
        received = torch.empty_like(sent)
        work = dist.all_to_all_single(received, sent, group=pg, async_op=True)  # equal splits: rank-major
        self.pending = (work, group, received, sent)  # `sent` stays referenced until the move is done

    def complete(self) -> None:
        if self.pending is None:
            return
        work, group, received, _sent = self.pending
        self.pending = None
        work.wait()
        group.push_round(received.view(group.world_size, -1))


class _Exchange(ReduceScatter):
    """FSDP's reduce-scatter for one group, replaced by a move of the pieces (no addition)."""

    def __init__(self, group: _Group, in_flight: _InFlight) -> None:
        self.group, self.in_flight = group, in_flight

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):  # noqa: ANN001
        self.in_flight.start(input_tensor, group, self.group)
        return None


def _padded_numel(fsdp_param, world_size: int) -> int:
    shape = _unsharded_shape(fsdp_param)
    return math.ceil(shape[0] / world_size) * world_size * math.prod(shape[1:])


def _unsharded_shape(fsdp_param) -> torch.Size:
    """The gradient FSDP packs for this parameter: its unsharded parameter's (under tensor
    parallelism, the local TP shard's) shape."""
    unsharded = fsdp_param._unsharded_param
    return unsharded.to_local().shape if isinstance(unsharded, DTensor) else unsharded.shape


class ShardedTree:
    """The deterministic FSDP2 gradient path of a sharded model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, world_size: int) -> None:
        self.world_size = world_size
        self.groups: list[_Group] = []
        self.in_flight = _InFlight()
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            param_group = module._get_fsdp_state()._fsdp_param_group
            if param_group is None:
                continue
            fsdp_params = [p for p in param_group.fsdp_params if p.sharded_param.requires_grad]
            group = _Group(name or "<root>", fsdp_params, world_size)
            self.groups.append(group)
            if world_size > 1:
                module.set_custom_reduce_scatter(_Exchange(group, self.in_flight))
            else:  # FSDP copies instead of reducing at W = 1; its hook sees the copy
                module.set_all_reduce_hook(lambda output, group=group: group.push_round(output.view(1, -1)))
        assert self.groups, "no FSDP-managed parameters"
        model.set_reduce_scatter_unused_params(True)  # every parameter in every packing, zeros if unused

    def start_step(self, num_microbatches: int) -> None:
        """A fresh tree per group over the step's V microbatches; last step's partials recycled."""
        if num_microbatches % self.world_size:
            raise ValueError(
                f"world size {self.world_size} must divide the number of virtual microbatches {num_microbatches}"
            )
        for group in self.groups:
            group.free.extend(group.lent)
            group.lent = []
            group.stack = TreeStack(num_microbatches, 0, group.give)
            group.rounds = 0

    def end_backward(self) -> None:
        """The microbatch's last exchange is done and pushed (call after each backward)."""
        self.in_flight.complete()

    def finish(self) -> None:
        """Every parameter's .grad = its reduced shard (views of the group's root partial)."""
        self.in_flight.complete()
        for group in self.groups:
            root = group.root()
            offset = 0
            for fsdp_param in group.fsdp_params:
                shard = torch.as_strided(
                    root, fsdp_param.sharded_size, fsdp_param.contiguous_sharded_stride, storage_offset=offset
                )
                assert shard.dtype == fsdp_param.sharded_param.dtype, (group.name, shard.dtype)  # fp32 masters
                fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(shard)
                offset += _padded_numel(fsdp_param, self.world_size) // self.world_size
            assert offset == root.numel(), (group.name, offset, root.numel())

    def partials_held(self) -> int:
        """Shard-sized partial buffers lent out now, over all groups."""
        return sum(len(g.lent) for g in self.groups)


def shard_model(
    model: torch.nn.Module, *, deterministic: bool = True, param_dtype: torch.dtype = torch.float32, mesh=None
) -> ShardedTree | None:
    """fully_shard every decoder block and the root (default mesh: all ranks). Deterministic: the
    tree above replaces FSDP's reduce-scatter (returned). Otherwise FSDP2 as usual (None): an
    averaging reduce-scatter per backward accumulated into the sharded .grad (the caller multiplies
    by W: the loss is already normalised by the global token count; gloo has no PREMUL_SUM for a
    factor of 1); the baseline and negative control of the deterministic path.

    param_dtype other than the parameters' (bf16 compute): FSDP2's MixedPrecisionPolicy casts
    each shard before the all-gather (elementwise: the bits of casting the full tensor, as the DP
    path does) and leaves the blocks' float inputs alone (RoPE tables stay fp32, as in DP);
    gradients are packed and reduced in fp32."""
    kwargs = {}
    if any(p.dtype != param_dtype for p in model.parameters()):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    if mesh is not None:  # the dp dimension of a (dp, tp) mesh: TP-sharded parameters become 2-D
        kwargs["mesh"] = mesh
        # full_tensor() of a 2-D parameter (audit records, checkpoints) is two all-gathers, exact
        # copies whatever their order; torch warns about it at every call
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP2 writes the gathered parameters behind their version counter: no packed-weight reuse
    disable_packed_cache()
    if not deterministic:
        return None
    world_size = mesh.size() if mesh is not None else dist.get_world_size()
    return ShardedTree(model, world_size)
