"""FSDP2 (`fully_shard`) with the deterministic gradient reduction instead of FSDP's reduce-scatter.

    grads = shard_model(model)             # every block, then the root; FSDP's own grad sync off
    loss.backward(); flat = grads.take_flat(params)     # this microbatch's full gradient, fp32
    ...TreeReducer over the V microbatches...
    grads.set_sharded(params, reduced_flat)             # each rank keeps its dim-0 shard as .grad

Guarantees:
- Parameters are sharded on dim 0 over the default group (FSDP2's layout), or with `mesh` over the
  dp dimension of a (dp, tp) mesh, composed with tensor parallelism: a TP-sharded parameter is
  then 2-D and its "full" gradient in the flat vector is its local TP shard (`full_tensors`
  gathers it). Forward and backward
  run on all-gathered (bit-exact) parameters with the same ops as replicated data parallel, so a
  microbatch's unsharded gradient has the same bits as in DP; FSDP's reduce-scatter is switched
  off (`set_requires_gradient_sync(False)`), and the gradient of each microbatch is taken from
  FSDP's unsharded gradient and fed to the fixed-tree reduction. So an FSDP2 run at any W has the
  audit log of a DP run at any W (tests/trainer/test_fsdp.py).
- The reduced gradient is the full vector on every rank (TreeReducer.all_reduce); each rank keeps
  its own shard of it (a local slice, no communication). Clipping is computed on the full vector,
  identical on every rank. AdamW is elementwise, so updating shards gives the bits of updating the
  whole tensors.
- bf16 compute (`param_dtype`): forward/backward on bf16 all-gathered parameters; the unsharded
  gradient is bf16 (FSDP2 keeps it widened to fp32 in `unsharded_accumulated_grad`, exactly), and
  `take_flat` adds it into the fp32 vector (0 + g), the DP path's bits; shards, reduced gradients
  and AdamW state stay fp32.
- Cost note: the reduction moves the volume of an all-reduce (not of a reduce-scatter), and each
  microbatch's unsharded gradient is held until it is flattened: memory is that of DP for
  gradients, FSDP's saving is kept for parameters and optimizer state.
This reads FSDP2's per-parameter unsharded gradient (`FSDPParam._unsharded_param.grad`, or
`FSDPParam.unsharded_accumulated_grad` under mixed precision), an
internal of torch.distributed.fsdp; it is checked on this torch (2.13) by the tests.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


class ShardedGrads:
    def __init__(self, model: torch.nn.Module) -> None:
        self.by_param = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    for fsdp_param in group.fsdp_params:
                        self.by_param[id(fsdp_param.sharded_param)] = fsdp_param
        assert self.by_param, "no FSDP-managed parameters"

    def _unsharded_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """The shape of p's gradient in the flat vector: FSDP's unsharded parameter (under tensor
        parallelism, its local TP shard)."""
        unsharded = self.by_param[id(p)]._unsharded_param
        return unsharded.to_local().shape if isinstance(unsharded, DTensor) else unsharded.shape

    def take_flat(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The microbatch's full gradient of every parameter (zeros where unused; under tensor
        parallelism, its local TP shard) as one fresh fp32 vector in parameter order; FSDP's
        unsharded gradients are cleared for the next microbatch."""
        numel = sum(self._unsharded_shape(p).numel() for p in params)
        flat = torch.zeros(numel, dtype=torch.float32, device=params[0].device)  # the run's device
        offset = 0
        for p in params:
            fsdp_param = self.by_param[id(p)]
            shape = self._unsharded_shape(p)
            unsharded = fsdp_param._unsharded_param
            # Mixed precision without gradient sync: FSDP moves the bf16 gradient into an fp32
            # `unsharded_accumulated_grad` (its exact widening); otherwise it stays on .grad.
            accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            assert accumulated is None or unsharded.grad is None, "both gradient slots are set"
            grad = accumulated if accumulated is not None else unsharded.grad
            if grad is not None:
                if isinstance(grad, DTensor):
                    grad = grad.to_local()
                assert grad.shape == shape, (grad.shape, shape)
                flat[offset : offset + shape.numel()].add_(grad.reshape(-1))  # 0 + g, as the DP path
                unsharded.grad = None
                fsdp_param.unsharded_accumulated_grad = None
            offset += shape.numel()
        return flat

    def full_tensors(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's full gradient from `flat` (take_flat's layout): under tensor
        parallelism a TP shard is gathered over its TP mesh (collective)."""
        out, offset = [], 0
        for p in params:
            shape = self._unsharded_shape(p)
            piece = flat[offset : offset + shape.numel()].view(shape)
            unsharded = self.by_param[id(p)]._unsharded_param
            if isinstance(unsharded, DTensor):
                piece = DTensor.from_local(piece, unsharded.device_mesh, unsharded.placements, run_check=False)
                piece = piece.full_tensor()
            out.append(piece)
            offset += shape.numel()
        assert offset == flat.numel(), (offset, flat.numel())
        return out

    def set_sharded(self, params: list[torch.nn.Parameter], flat: torch.Tensor, *, gathered: bool = False) -> None:
        """Each parameter's .grad = this rank's shard of its slice of the full reduced vector:
        `flat` in take_flat's layout, or with `gathered` already the full tensors end to end."""
        fulls = _slices(params, flat) if gathered else self.full_tensors(params, flat)
        for p, full in zip(params, fulls, strict=True):
            p.grad = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def _slices(params: list[torch.nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    """Every parameter's full (logical) shape, cut from `flat` in parameter order."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    assert offset == flat.numel(), (offset, flat.numel())
    return out


def shard_model(
    model: torch.nn.Module, *, deterministic: bool = True, param_dtype: torch.dtype = torch.float32, mesh=None
) -> ShardedGrads:
    """fully_shard every decoder block and the root (default mesh: all ranks). Deterministic: FSDP's
    gradient sync off (the tree reduction replaces it). Otherwise FSDP2 as usual: an averaging
    reduce-scatter per backward accumulated into the sharded .grad (the caller multiplies by W: the
    loss is already normalised by the global token count; gloo has no PREMUL_SUM for a factor of
    1); the baseline and negative control of the deterministic path.

    param_dtype other than the parameters' (bf16 compute): FSDP2's MixedPrecisionPolicy casts
    each shard before the all-gather (elementwise: the bits of casting the full tensor, as the DP
    path does) and leaves the blocks' float inputs alone (RoPE tables stay fp32, as in DP);
    gradient reductions (the native path's) run in fp32."""
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
    if deterministic:
        model.set_requires_gradient_sync(False)
    return ShardedGrads(model)
