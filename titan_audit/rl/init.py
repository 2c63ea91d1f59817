"""Where an RL run's policy starts, and the policy as the trainer holds it: a train (or RL) run's
latest checkpoint, an HF model directory, or the deterministic init of (config.model, seed). The
init logic is shared with `train --init` (trainer/init.py); this file builds the policy, its KL
reference and the prompt ids a rank serves.

Guarantees (trainer/init.py's): the init's weights load bitwise (a run's checkpoint verified
against its hashes.json) into a model of the config's shape, which the launcher took from the
init; the loop records their digest (layout-invariant: audit/fingerprint.py), so a resume whose
init changed is refused.

Layouts (`build_policy`): data parallel builds the whole model on the CPU, records it, moves it to
the rank's device, then shards it over the tp ranks (`parallel.tp`); its KL reference is a full
frozen copy. FSDP2 (`parallel.mode = "fsdp"`) lays the model out on the meta device with the
trainer's machinery (trainer/materialize.py `laid_out`: TP, then FSDP2's dim-0 shards), allocates
only this rank's pieces and fills them from the init or the seed (every element the bits of the
whole build); the KL reference is laid out the same way and takes the policy's shards, so no rank
holds a full copy of either. Under FSDP2 rank r of W serves the prompt groups k*W + r (`prompt_ids`:
the microbatches of the sharded gradient tree, trainer/fsdp.py), under DP the block [r*P/W, (r+1)*P/W).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titan_audit.models import Transformer, build
from titan_audit.models.init import init_weights
from titan_audit.rl.config import RLConfig
from titan_audit.trainer.fsdp import ShardedTree
from titan_audit.trainer.init import load_init, record_init_weights
from titan_audit.trainer.materialize import laid_out
from titan_audit.trainer.reduce import rank_block
from titan_audit.trainer.tensor_parallel import parallelize


def load_initial_model(config: RLConfig, init: str | os.PathLike | None) -> Transformer:
    """The policy's starting weights: a train (or RL) run's latest checkpoint, an HF directory, or
    the deterministic init of (config.model, seed); on the CPU, whatever `parallel.device` (the
    loop moves it)."""
    model = build(config.model.model_config(), seed=config.seed)
    if init is not None:
        load_init(model, init, portable=config.determinism.batch_invariant)
    return model


@dataclass
class Policy:
    model: Transformer  # the trainer's policy, in the run's layout on the run's device
    reference: Transformer | None  # the frozen initial policy (loss.kl_coef > 0), the same layout
    sharded: ShardedTree | None  # FSDP2's gradient path (trainer/fsdp.py), for StepKit


def build_policy(config: RLConfig, run, init: str | os.PathLike | None) -> Policy:
    """The policy and its KL reference in the run's layout (module docstring); the init's digest
    recorded in the manifest (checked on a resume). Collective under FSDP2 and TP."""
    kl = config.loss.kl_coef > 0
    device = run.mesh.device
    if config.parallel.mode == "fsdp":
        model, sharded = laid_out(config, run.mesh)
        model.to_empty(device=device)
        if init is None:
            init_weights(model, config.seed, model.config.initializer_range)
        else:
            load_init(model, init)
        record_init_weights(run, model)
        reference = None
        if kl:
            reference, _ = laid_out(config, run.mesh)  # its tree stays unused: it never runs a backward
            reference.to_empty(device=device)
            with torch.no_grad():
                reference.load_state_dict(model.state_dict())  # shard to shard, nothing gathered
            reference.requires_grad_(False)
        return Policy(model, reference, sharded)
    model = load_initial_model(config, init)  # on the CPU: the initial bits are the CPU's
    record_init_weights(run, model)
    reference = None
    if kl:
        reference = build(config.model.model_config(), seed=config.seed)
        reference.load_state_dict(model.state_dict())
        reference.requires_grad_(False).to(device)
    model.to(device)  # on cpu: nothing moves
    parallelize(model, run.mesh.tp_mesh)  # at tp > 1; the generator keeps a TP=1 copy
    return Policy(model, reference, None)


def prompt_ids(config: RLConfig, dp: int, dp_rank: int) -> list[int]:
    """The prompt ids (= microbatch indices) dp rank `dp_rank` of `dp` serves each step, ascending."""
    P = config.task.prompts_per_step
    if config.parallel.mode == "fsdp":
        return list(range(dp_rank, P, dp))
    lo, hi = rank_block(P, dp, dp_rank)
    return list(range(lo, hi))
