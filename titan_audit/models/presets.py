"""Named model presets: tiny ones for tests and the demo, real shapes for users with hardware.

- `tiny-dense` (~4M parameters) and `tiny-moe` (~7M parameters, 8 experts, top-2): a training
  step on a few hundred tokens takes well under a second on 2 CPU cores.
- `qwen3-0.6b`: the Qwen3-0.6B shapes (tied embeddings, q/k-norm, GQA 16/8, head_dim 128).
- `qwen3-moe-small`: a small Qwen3-MoE-like model (32 experts, top-4, ~1.6B total parameters).
- `llama-tiny`: a Llama-layout model (no q/k-norm) of the same size as `tiny-dense`.

`get_preset(name)` raises `ValueError` listing the known names for an unknown one.
"""

from __future__ import annotations

import dataclasses

from titan_audit.models.config import ModelConfig

_TINY_DENSE = ModelConfig(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=2048,
    rope_theta=10_000.0,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny-dense": _TINY_DENSE,
    "tiny-moe": dataclasses.replace(
        _TINY_DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True
    ),
    "llama-tiny": dataclasses.replace(_TINY_DENSE, rope_theta=500_000.0, rms_norm_eps=1e-5, qk_norm=False),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151_936,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-moe-small": ModelConfig(
        vocab_size=151_936,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`; ValueError listing the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None
