"""Tensor parallelism for models/'s decoder, on torch's own engine (DeviceMesh, DTensor,
`parallelize_module`), with the bits of the unsharded model.

    tp_mesh = mesh["tp"]                              # a (dp, tp) DeviceMesh's tp dimension
    check_layout(model.config, tp)                   # ValueError naming the dimension that breaks the rule
    parallelize(model, tp_mesh)                      # q/k/v, gate/up, LM head column-wise; o, down row-wise

What is sharded: attention heads (q/k/v column-wise with their heads, o_proj row-wise), the
SwiGLU MLP (gate/up column-wise, down row-wise), and an untied LM head over the vocabulary
(column-wise, its logits gathered). Replicated on every TP rank: the embedding (a lookup: no
reduction to split), the norms, MoE routers and experts (expert parallelism is not built), and a
tied LM head. A replicated parameter's gradient is computed from replicated inputs, so it is the
same on every TP rank; a sharded one's gradient is this rank's shard of the TP=1 gradient.

The numerics are models/tensor_parallel.py's: its linears read the layout from the weight's
placement (Shard(0) column-wise, Shard(1) row-wise) and combine partial sums by the fixed tree.
The rule (`check_layout`): tp divides the heads and the kv heads, and for every dimension a
shard splits in a reduction (the heads' width, the kv heads' width, the MLP width, the
vocabulary), tp divides that dimension's gemm block count P(K) (v2 order). The v1 gemm order
(one chain over K) has no subtree to split: TP > 1 is refused under it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan_audit.models.config import ModelConfig
from titan_audit.models.tensor_parallel import check_divisible, use_partials_reducer
from titan_audit.trainer.reduce import all_reduce_partials


class _ShardWeight(ParallelStyle):
    """The module's `weight` becomes a DTensor sharded on `dim` over the TP mesh; nothing else
    (no hooks: the model calls models/ops.linear with the weight, which reads the placement)."""

    dim = 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear) and module.bias is None, module
        weight = module.weight
        sharded = distribute_tensor(weight.detach(), device_mesh, [Shard(self.dim)], src_data_rank=None)
        module.weight = nn.Parameter(sharded, requires_grad=weight.requires_grad)
        return module


class FixedOrderColwise(_ShardWeight):
    """Column-wise: weight [N, K] sharded on N (each rank computes N/t output columns)."""

    dim = 0


class FixedOrderRowwise(_ShardWeight):
    """Row-wise: weight [N, K] sharded on K (each rank's partial sum over K/t, tree-combined)."""

    dim = 1


def check_layout(config: ModelConfig, tp: int, *, gemm_order: str = "v2") -> None:
    """ValueError (naming the key and the dimension) unless `tp` shards every sharded dimension
    into whole subtrees of its reduction (see the module doc)."""
    if tp == 1:
        return
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1, got {tp}")
    if gemm_order != "v2":
        raise ValueError(
            f"parallel.tp = {tp} needs determinism.bi_kernels = 'v2' (the blocked-tree gemm order "
            f"a shard can reproduce), got {gemm_order!r}"
        )
    for name, count in (("model.num_attention_heads", config.num_attention_heads),
                        ("model.num_key_value_heads", config.num_key_value_heads)):  # fmt: skip
        if count % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide {name} = {count}")
    check_divisible("model.num_attention_heads * head_dim", config.num_attention_heads * config.head_dim, tp)
    check_divisible("model.num_key_value_heads * head_dim", config.num_key_value_heads * config.head_dim, tp)
    dense_layers = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
    if dense_layers:
        check_divisible("model.intermediate_size", config.intermediate_size, tp)
    if not config.tie_word_embeddings:
        if config.vocab_size % tp:
            raise ValueError(f"parallel.tp = {tp} does not divide model.vocab_size = {config.vocab_size}")
        check_divisible("model.vocab_size", config.vocab_size, tp)


_COLWISE = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".mlp.gate_proj", ".mlp.up_proj")
_ROWWISE = (".self_attn.o_proj", ".mlp.down_proj")  # a dense block's MLP only (an MoE's experts stay whole)


def check_tensor_parallel(config) -> None:  # noqa: ANN001
    """A train or RL config's `parallel.tp` against its model and numerics (ValueError naming the
    key): the layout rule (`check_layout`, under the configured gemm order in BI mode), and audit
    level `full` refused at tp > 1 (module outputs there are this rank's heads or columns)."""
    tp = config.parallel.tp
    if tp == 1:
        return
    if config.audit.level == "full":
        raise ValueError(
            f"audit.level = 'full' records module outputs, which are sharded at parallel.tp = {tp}; "
            "use audit.level = 'params' (every data, loss, log-prob, gradient, optimizer and parameter record)"
        )
    order = getattr(config.determinism, "bi_kernels", "v2") if config.determinism.batch_invariant else "v2"
    check_layout(config.model.model_config(), tp, gemm_order=order)


def plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a models/ Transformer: {module name: style}."""
    out: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name == "lm_head" or name.endswith(_COLWISE):
            out[name] = FixedOrderColwise()
        elif name.endswith(_ROWWISE):
            out[name] = FixedOrderRowwise()
    return out


def parallelize(model: nn.Module, tp_mesh: DeviceMesh | None) -> nn.Module:
    """Shard `model`'s linears over `tp_mesh` by `plan` (in place; returns the model); None (tp = 1):
    the model as it is. A model on the meta device is laid out without data or communication
    (each rank cuts its own piece, `src_data_rank=None`), to be allocated with `to_empty` and
    filled shard by shard (trainer/materialize.py)."""
    if tp_mesh is None:
        return model
    assert tp_mesh.ndim == 1, tp_mesh
    check_layout(model.config, tp_mesh.size())
    use_partials_reducer(all_reduce_partials)  # the fixed tree; a reduce-scatter above 1 MB
    with torch.no_grad():
        return parallelize_module(model, tp_mesh, plan(model))
