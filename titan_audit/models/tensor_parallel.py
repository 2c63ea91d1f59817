"""Tensor-parallel linears whose bits are the unsharded (TP=1) linear's, by construction.

A weight that is a DTensor sharded over a 1-D tensor-parallel mesh says how its linear runs:
- `Shard(0)` (column-wise, e.g. q/k/v, gate/up, the LM head): x [..., K] is replicated, each rank
  computes its N/t output columns. Backward: the input gradient is a sum over N, which the layout
  splits: each rank's partial sum over its N/t columns stays float32 and the t partials combine by
  `reduce_partials`, then round once to x's dtype.
- `Shard(1)` (row-wise, o_proj, down_proj): x [..., K/t] is this rank's slice of K; each rank's
  partial sum over its K/t stays float32, the partials combine by `reduce_partials` and round once.
  Backward: the input gradient and the weight gradient are this rank's columns / rows of the
  unsharded ones (sums over N and over tokens, which the layout does not split).

Why the bits match TP=1 (batch-invariant mode, gemm order v2 of batch_invariant/cpu/matmul.py):
a v2 gemm sums K in P(K) blocks (one fma chain each) combined by a halving tree over the block
index. When t divides P(K), a shard of K/t is a whole subtree: the local kernel sums it in
P(K/t) = P(K)/t blocks by the same tree, and `reduce_partials` finishes the top log2(t) levels
over the rank index. So each output element goes through the same fp32 operations in the same
order; bfloat16 results round once, where TP=1 rounds. Other gradient sums are over tokens, which
TP never splits. `check_divisible` states the rule; a layout that breaks it is refused (ValueError
naming the dimension), never run with other bits.
Outside batch-invariant mode the same layout runs on native kernels with a plain all_reduce (the
conventional tensor parallelism: no promise beyond torch's; the negative control).
q, k and v are three linears whose input gradients autograd adds in the TP=1 order: each is
reduced across ranks on its own before the add, as TP=1 sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard

from titan_audit import batch_invariant
from titan_audit.batch_invariant.cpu.matmul import tree_blocks, tree_combine

COLWISE, ROWWISE = "colwise", "rowwise"


def check_divisible(name: str, size: int, tp: int) -> None:
    """ValueError unless `tp` shards of the reduced dimension `name` (of `size`) are whole subtrees
    of the v2 gemm tree: tp divides tree_blocks(size) (P(K): the largest power of two P with
    K % P == 0 and K / P >= 64)."""
    if tp == 1:
        return
    blocks = tree_blocks(size)
    if blocks % tp:
        raise ValueError(
            f"parallel.tp = {tp}: {name} = {size} is summed in {blocks} block(s) of {size // blocks} "
            f"(the gemm's v2 tree: the largest power of two P with {size} % P == 0 and {size} / P >= 64), "
            f"which {tp} shards cannot split into whole subtrees; use parallel.tp in "
            f"{[t for t in (1, 2, 4, 8, 16, 32) if blocks % t == 0]}"
        )


def reduce_partials(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of every rank's `partial` by the halving tree over the group's rank index (one
    all-gather, then the tree locally): the same bits on every rank, whatever the transport."""
    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, partial.contiguous(), group=group)
    return tree_combine(parts)


_PARTIALS_REDUCER = [reduce_partials]


def use_partials_reducer(reduce: Callable[[torch.Tensor, dist.ProcessGroup], torch.Tensor]) -> None:
    """The cross-rank sum the linears use: `reduce(partial, group)` must give `reduce_partials`'s
    bits (the halving tree over the rank index) by any transport. The trainer installs
    `trainer.reduce.all_reduce_partials` (the same tree; above 1 MB a reduce-scatter and an
    all-gather, which move less than one all-gather of every rank's partial)."""
    _PARTIALS_REDUCER[0] = reduce


def _sum_partials(partial_f32: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype) -> torch.Tensor:
    if batch_invariant.is_enabled():
        return _PARTIALS_REDUCER[0](partial_f32, group).to(dtype)
    dist.all_reduce(partial_f32, group=group)  # conventional TP: the order is gloo's / NCCL's
    return partial_f32.to(dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return batch_invariant.mm(a, b) if batch_invariant.is_enabled() else a @ b


class _Colwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group = group
        return batch_invariant.linear(x, w) if batch_invariant.is_enabled() else F.linear(x, w)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gy2 = grad_y.reshape(-1, w.shape[0])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # sum over N, split by the layout: fp32 partials, one rounding
            partial = _mm(gy2.float(), w.float())
            grad_x = _sum_partials(partial, ctx.group, x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:  # sum over tokens: this rank's rows of the TP=1 gradient
            grad_w = _mm(x.reshape(-1, x.shape[-1]).t(), gy2).t()
        return grad_x, grad_w, None


class _Rowwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group = group
        x2 = x.reshape(-1, x.shape[-1])
        partial = _mm(x2.float(), w.float().t())  # sum over this rank's K/t, kept fp32
        return _sum_partials(partial, group, x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gy2 = grad_y.reshape(-1, w.shape[0])
        grad_x = _mm(gy2, w).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = _mm(x.reshape(-1, x.shape[-1]).t(), gy2).t() if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _GatherLastDim(torch.autograd.Function):
    """All ranks' [..., N/t] blocks side by side (rank order); backward: this rank's block."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, y.shape[-1]
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, y.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        start = dist.get_rank(ctx.group) * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


class _ScaleHeads(torch.autograd.Function):
    """weight [d] * normed [B, T, H/t, d]; the weight's gradient is the TP=1 one: the products of
    every rank's heads, gathered in head order, summed by the same `sum_to_size` as autograd's."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, normed: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(weight, normed)
        ctx.group = group
        return weight * normed

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, normed = ctx.saved_tensors
        grad_normed = grad * weight if ctx.needs_input_grad[1] else None
        grad_weight = None
        if ctx.needs_input_grad[0]:
            local = (grad * normed).contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ctx.group))]
            dist.all_gather(parts, local, group=ctx.group)
            grad_weight = torch.cat(parts, dim=2).sum_to_size(weight.shape)
        return grad_weight, grad_normed, None


def scale_heads(weight: torch.Tensor, normed_BTHd: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`weight * normed` for a per-head norm whose heads are sharded over `group` (q/k-norm under
    tensor parallelism): the forward is per head; the weight's gradient sums over all heads."""
    return _ScaleHeads.apply(weight, normed_BTHd, group)


def layout(weight: DTensor) -> str:
    """COLWISE (Shard(0)) or ROWWISE (Shard(1)) of a weight sharded over a 1-D mesh."""
    placements = weight.placements
    assert len(placements) == 1 and isinstance(placements[0], Shard), placements
    assert placements[0].dim in (0, 1), placements
    return COLWISE if placements[0].dim == 0 else ROWWISE


def _fresh_version(weight: DTensor) -> None:
    """Bump the local shard's version counter, so the gemm's packed-weight cache
    (batch_invariant/cpu/matmul.py), which trusts that counter, packs this weight afresh. Writes
    into a DTensor's local shard can bypass the counter (an in-place op on the DTensor bumps the
    wrapper's only; FSDP2's all-gather refills the unsharded shard's memory), so a tensor-parallel
    weight is never served from the cache: correctness first, the cost is one packing per call."""
    with torch.no_grad():
        torch.autograd.graph.increment_version(weight.to_local())  # an alias: one shared counter


def linear(x: torch.Tensor, weight: DTensor, *, gather_output: bool = False) -> torch.Tensor:
    """x @ weight.T for a tensor-parallel weight (see the module doc); x and the result are local
    tensors: column-wise returns this rank's columns unless `gather_output` (the LM head: the
    full [..., N], gathered in rank order), row-wise takes this rank's K slice and returns the
    full (replicated) result."""
    group = weight.device_mesh.get_group()
    _fresh_version(weight)
    w = weight.to_local()  # differentiable: the parameter's gradient comes back sharded alike
    if layout(weight) == ROWWISE:
        return _Rowwise.apply(x, w, group)
    y = _Colwise.apply(x, w, group)
    return _GatherLastDim.apply(y, group) if gather_output else y
