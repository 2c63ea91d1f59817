"""Typed model configuration for the Qwen3/Llama-style decoder and its MoE variant.

Guarantees: a `ModelConfig` that constructs is internally consistent (head counts divide, top-k
fits the expert count, every size positive); anything inconsistent raises `ValueError` naming
the field. Field names follow the Hugging Face `config.json` keys, so the HF mapping in
`hf_config.py` is a rename-free copy for the shared keys.

Dense vs MoE: `num_experts == 0` is a dense model. With experts, layer `i` is an MoE layer iff
`i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0` (the Qwen3-MoE rule); other
layers use a dense SwiGLU MLP of `intermediate_size`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder. Sizes are in elements; all fields are plain values."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Mixture of experts (num_experts == 0: dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.initializer_range <= 0:
            raise ValueError("ModelConfig.rope_theta, rms_norm_eps and initializer_range must be > 0")
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}],"
                    f" got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("ModelConfig.moe_intermediate_size must be > 0 for an MoE model")
            if self.decoder_sparse_step <= 0:
                raise ValueError("ModelConfig.decoder_sparse_step must be > 0")
            if self.shared_expert_intermediate_size < 0:
                raise ValueError("ModelConfig.shared_expert_intermediate_size must be >= 0")
        elif self.shared_expert_intermediate_size:
            raise ValueError("ModelConfig.shared_expert_intermediate_size needs num_experts > 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"ModelConfig.mlp_only_layers has out-of-range layer indices {bad}")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            if self.intermediate_size <= 0:
                raise ValueError("ModelConfig.intermediate_size must be > 0 (a layer has a dense MLP)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """True iff layer `layer` uses the routed experts (the Qwen3-MoE sparse-step rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["mlp_only_layers"] = list(self.mlp_only_layers)
        return data
