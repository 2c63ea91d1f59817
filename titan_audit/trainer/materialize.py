"""A training model materialised where it lives: each rank allocates and fills only what it holds.

    model, sharded = build_model(config, run)    # the train loop's model (train.py)

The model is built on the meta device (shapes only), laid out there (tensor parallelism, then
FSDP2's dim-0 sharding), then `to_empty` on the rank's device allocates each parameter's local
piece and the weights are filled in place: from the init the manifest names (trainer/init.py:
an HF directory read slice by slice, another run's checkpoint through DCP into the shards) or
from the seed (models/init.py: each local block from its own Philox counters). No rank ever
holds a full copy of a sharded parameter (one exception: DCP reads a stored chunk whole before it
cuts the local piece out, so a run init from a checkpoint written at W = 1 reads each parameter
whole, one at a time), and every element has the bits the whole-model build gives it, so the
layout never reaches the numerics. Data parallel without TP replicates the
model by definition: there the local piece is the whole tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_audit.models import Transformer
from titan_audit.models.build import build_meta
from titan_audit.models.init import init_weights
from titan_audit.trainer.config import TrainConfig
from titan_audit.trainer.fsdp import shard_model
from titan_audit.trainer.init import load_run_init
from titan_audit.trainer.tensor_parallel import parallelize

if TYPE_CHECKING:
    from titan_audit.trainer.fsdp import ShardedTree
    from titan_audit.trainer.mesh import Mesh
    from titan_audit.trainer.run import Run


def build_model(config: TrainConfig, run: Run) -> tuple[Transformer, ShardedTree | None]:
    """The train loop's model and FSDP2's gradient path (None outside FSDP2's deterministic mode)."""
    model, sharded = laid_out(config, run.mesh)
    model.to_empty(device=run.mesh.device)
    if not load_run_init(run, model):
        init_weights(model, config.seed, model.config.initializer_range)
    if config.parallel.mode != "fsdp":
        model.set_compute_dtype(config.model.torch_compute_dtype)  # cast once per forward, inside autograd
    return model, sharded


def laid_out(config: TrainConfig, mesh: Mesh) -> tuple[Transformer, ShardedTree | None]:
    """The model on the meta device with the run's layout: TP linears sharded over the tp mesh
    (tp > 1), then FSDP2 over the dp ranks (`parallel.mode = "fsdp"`; it casts the gathered
    parameters to the compute dtype itself). Returns (model, shard_model's result or None)."""
    model = build_meta(config.model.model_config())
    model.set_activation_checkpointing(config.model.activation_checkpointing)
    parallelize(model, mesh.tp_mesh)  # q/k/v, gate/up, LM head column-wise; o/down row-wise
    if config.parallel.mode != "fsdp":
        return model, None
    dtype = config.model.torch_compute_dtype
    deterministic = config.determinism.enabled
    return model, shard_model(model, deterministic=deterministic, param_dtype=dtype, mesh=mesh.fsdp_mesh())
