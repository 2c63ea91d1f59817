"""Mapping between `ModelConfig` and Hugging Face `config.json` (Qwen3, Qwen3-MoE, Llama).

Reading: `model_type` picks the family (`qwen3`: q/k-norm; `qwen3_moe`: q/k-norm + experts;
`llama`: no q/k-norm). A missing required key raises `ValueError` naming the file and the key;
features this decoder does not implement (bias terms, non-SiLU activations, sliding windows,
RoPE scaling) raise `ValueError` naming the key instead of loading something different.
Both the v4 (`rope_theta`, `num_experts`) and v5 (`rope_parameters`, `num_local_experts`)
spellings are read.

Writing: the family follows from the config (experts -> qwen3_moe, q/k-norm -> qwen3, else
llama), with both rope spellings so old and new transformers read it. A shared expert is this
project's extension of Qwen3-MoE (keys as in Qwen2-MoE: `shared_expert_intermediate_size`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`); HF's Qwen3-MoE does not run it.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_audit.models.config import ModelConfig

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
}
_DEFAULT_MAX_POSITIONS = {"qwen3": 32768, "qwen3_moe": 32768, "llama": 2048}


def config_from_hf(data: dict[str, Any], source: str) -> ModelConfig:
    """A ModelConfig from a parsed config.json; `source` (the file) is named in every error."""

    def need(key: str) -> Any:
        if key not in data or data[key] is None:
            raise ValueError(f"{source}: missing config key {key!r}")
        return data[key]

    model_type = need("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    _reject_unsupported(data, source)
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    is_moe = model_type == "qwen3_moe"
    fields: dict[str, Any] = {
        "vocab_size": int(need("vocab_size")),
        "hidden_size": hidden,
        "num_hidden_layers": int(need("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(data.get("num_key_value_heads") or heads),
        "head_dim": int(data.get("head_dim") or hidden // heads),
        # An MoE model needs intermediate_size only for its dense layers (ModelConfig checks).
        "intermediate_size": int(data.get("intermediate_size") or 0) if is_moe else int(need("intermediate_size")),
        "max_position_embeddings": int(data.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]),
        "rope_theta": _rope_theta(data),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "qk_norm": model_type != "llama",
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "initializer_range": float(data.get("initializer_range", 0.02)),
    }
    if is_moe:
        experts = data.get("num_experts", data.get("num_local_experts"))
        if experts is None:
            raise ValueError(f"{source}: missing config key 'num_experts'")
        fields.update(
            num_experts=int(experts),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            norm_topk_prob=bool(data.get("norm_topk_prob", False)),
            decoder_sparse_step=int(data.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(data.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(data.get("shared_expert_intermediate_size") or 0),
        )
    try:
        return ModelConfig(**fields)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _rope_theta(data: dict[str, Any]) -> float:
    if data.get("rope_theta") is not None:
        return float(data["rope_theta"])
    params = data.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10_000.0))


def _reject_unsupported(data: dict[str, Any], source: str) -> None:
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if data.get(key):
            raise ValueError(f"{source}: {key}=true is not supported")
    for key in ("rope_scaling", "rope_parameters"):
        rope = data.get(key)
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{source}: {key} of type {rope.get('rope_type', rope.get('type'))!r} is not supported")


def model_type_of(config: ModelConfig) -> str:
    if config.is_moe:
        return "qwen3_moe"
    return "qwen3" if config.qk_norm else "llama"


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json dict for `config` with weights stored in `dtype`."""
    model_type = model_type_of(config)
    if config.is_moe and not config.qk_norm:
        raise ValueError("an MoE model without q/k-norm has no HF layout (Qwen3-MoE has q/k-norm)")
    data: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "llama":
        data["mlp_bias"] = False
    else:
        data["use_sliding_window"] = False
        data["sliding_window"] = None
    if config.is_moe:
        data.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers),
        )
        if config.shared_expert_intermediate_size:
            data["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return data
