"""The policy's weights on an RL rank: which copies exist in which setting, what a rollout job
carries, and the fingerprints that check a weight sync.

    plan = WeightPlan.of(config)                        # which copies this run's setting needs
    weights = job_weights(live_weights(model), plan, mesh)   # what the job of a version carries
    fingerprints = shard_fingerprints(weights)           # trainer side: per shard, few bytes moved

Copies of the weights per rank (besides the optimizer's own state):
- the trainer's model: whole (DP), TP-sharded (`parallel.tp`), or dim-0 sharded over the ranks
  (`parallel.mode = "fsdp"`, trainer/fsdp.py; with TP composed);
- the KL reference (`loss.kl_coef > 0`): the initial policy, frozen: its own shards under FSDP2,
  a full copy under DP (tp = 1 or more: rl/init.py);
- the generator's model: none when the generator runs the trainer's own module (`plan.share`:
  built-in generator, lag 0, DP at tp = 1, no control run: the trainer waits for the rollouts,
  so nothing changes the version-k weights while they run; generation runs under no_grad in BI
  mode). Otherwise exactly one full copy (rl/builtin.py): at lag > 0 the trainer moves on while
  rollouts run; a TP- or FSDP2-sharded model cannot generate rank-locally (its forward
  communicates in lockstep while ranks decode different numbers of steps); a control run sends
  the generator a perturbed copy (rl/control.py); vLLM holds its own engine copy. A sync copies
  it parameter by parameter, a sharded parameter's full tensor gathered one at a time.
- the job's weights (`job_weights`): at lag 0 the trainer's live tensors, no copy; at lag > 0 a
  snapshot of version k, which the trainer's next steps would overwrite: a clone of each tensor
  under DP; under FSDP2 at tp = 1 a clone of this rank's shards only (1/W of the model), put on
  `rollout_mesh` (a second process group, so the worker thread's gathers never interleave with
  the trainer's collectives); under TP a gathered full tensor per parameter.
- the same-weights scorer (lag > 0 with `verify`, rl/rollout_schedule.py): the generator's model,
  which holds the job's weights once the sync check passed; its own copy only where the
  generator's model is not those weights or not a models/ module (a control run, vLLM).

Fingerprints: `shard_fingerprints` is audit/fingerprint.py's digest of each logical tensor (xxh3
of the bytes up to 2 MiB, the lattice digest above), computed from the pieces each rank holds
(audit/exchange.py `combine`: 16 bytes per tensor above 2 MiB and rank; a smaller tensor's pieces
go to one rank, which hashes it and sends the digest string; no full_tensor, no clone). The
generator hashes its full tensors with the same `fingerprint`; the digest does not depend on the
layout, so the two sides' strings are equal exactly when the bits are, name by name, and strings
stored in older checkpoints compare as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_audit.audit import exchange
from titan_audit.audit.fingerprint import fingerprint, lattice_digest, whole_hash_bytes


@dataclass(frozen=True)
class WeightPlan:
    """share: the generator runs the trainer's module (no generator copy, no snapshot); snapshot:
    jobs carry a copy of their version (lag > 0), else the trainer's live tensors; shard_snapshot:
    that copy holds this rank's FSDP2 shards only (on the rollout mesh)."""

    share: bool
    snapshot: bool
    shard_snapshot: bool

    @classmethod
    def of(cls, config) -> WeightPlan:
        lag, fsdp = config.rollout.lag, config.parallel.mode == "fsdp"
        share = (
            config.generator == "builtin"
            and lag == 0
            and not fsdp
            and config.parallel.tp == 1
            and config.control is None
        )
        return cls(share=share, snapshot=lag > 0, shard_snapshot=lag > 0 and fsdp and config.parallel.tp == 1)


def rollout_mesh(plan: WeightPlan, device_type: str):
    """The 1-D mesh over a process group of every rank that shard snapshots live on (collective:
    every rank creates it at the same point), or None where the plan has no shard snapshots."""
    if not plan.shard_snapshot:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(dist.get_world_size())))
    return DeviceMesh.from_group(group, device_type)


def live_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as its own tensors (detached views: nothing copied, DTensors as they are)."""
    return {name: t.detach() for name, t in model.state_dict().items()}


def job_weights(live: Mapping[str, torch.Tensor], plan: WeightPlan, mesh=None) -> dict[str, torch.Tensor]:
    """What the job of the current version carries (module docstring), from `live_weights`: those
    tensors themselves (no snapshot), or a snapshot; collective where a parameter is gathered
    (every rank calls it at the same point, in the trainer's thread)."""
    if not plan.snapshot:
        return dict(live)
    out = {}
    for name, t in live.items():
        if not isinstance(t, DTensor):
            out[name] = t.clone()
        elif mesh is not None and t.device_mesh.ndim == 1 and t.device_mesh.size() == mesh.size():
            local = t.to_local().clone()
            out[name] = DTensor.from_local(local, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        else:
            out[name] = t.full_tensor()  # TP: the gathered parameter, one at a time
    return out


def full_weight(t: torch.Tensor) -> torch.Tensor:
    """A weight's full tensor: itself, or a DTensor's gathered (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_fingerprints(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> audit `fingerprint` of each logical tensor, DTensors from their shards (module
    docstring). Collective when some are DTensors (every rank calls it at the same point, with the
    same names in the same order): a DTensor above the whole-hash limit is digested from every
    rank's 16 bytes of lanes (one gather for all of them); one at or below it is hashed whole by
    one rank of its mesh, which receives its pieces (one gather per tensor, so no rank ever holds
    more than one such tensor gathered), and the digests travel as strings."""
    names = list(weights)
    out: dict[str, str] = {}
    sharded = [n for n in names if isinstance(weights[n], DTensor)]
    limit = whole_hash_bytes()
    large = [n for n in sharded if weights[n].numel() * weights[n].element_size() > limit]
    small = [n for n in sharded if n not in large]
    if large:
        items = [(weights[n], False, None) for n in large]
        for n, c in zip(large, exchange.combine(items, whole_bytes=limit, partial_stats=None), strict=True):
            assert c is not None and c.lanes is not None, "every rank receives the lanes"
            out[n] = lattice_digest(weights[n].dtype, tuple(weights[n].shape), c.lanes)
    hashed: dict[str, str] = {}
    for i, n in enumerate(small):
        _, ranks = exchange.group_of(weights[n].device_mesh)
        dst = ranks[i % len(ranks)]  # the hashing spreads over the mesh's ranks
        (c,) = exchange.combine([(weights[n], False, dst)], whole_bytes=limit, partial_stats=None)
        if c is not None:
            hashed[n] = fingerprint(c.full)
    if small:
        box: list = [None] * dist.get_world_size()
        dist.all_gather_object(box, hashed)  # replicas of a mesh (TP groups) hashed the same bits
        for part in box:
            out.update(part)
    for n in names:
        if n not in out:
            out[n] = fingerprint(weights[n])
    return {n: out[n] for n in names}


def shares_storage(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of `weights` is the module's own tensor of that name (same memory)."""
    own = module.state_dict()
    return own.keys() == weights.keys() and all(
        own[n].data_ptr() == weights[n].data_ptr() and own[n].shape == weights[n].shape for n in own
    )
