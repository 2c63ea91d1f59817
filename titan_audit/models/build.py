"""`build(preset_or_config)`: a freshly initialised model from a preset name or a ModelConfig.

The model is constructed on the meta device (`build_meta`: shapes only, no allocation; what a
sharded run lays out before it allocates, trainer/materialize.py), materialised on `device`, cast
to `dtype` and initialised from `seed` (see `init.py`): the same arguments give bitwise the same
weights on every machine, whole or shard by shard.
"""

from __future__ import annotations

import torch

from titan_audit.models.config import ModelConfig
from titan_audit.models.init import init_weights
from titan_audit.models.presets import get_preset
from titan_audit.models.transformer import Transformer


def resolve_config(preset_or_config: str | ModelConfig) -> ModelConfig:
    if isinstance(preset_or_config, ModelConfig):
        return preset_or_config
    if isinstance(preset_or_config, str):
        return get_preset(preset_or_config)
    raise ValueError(f"expected a preset name or a ModelConfig, got {type(preset_or_config).__name__}")


def build_meta(preset_or_config: str | ModelConfig) -> Transformer:
    """The model on the meta device: every parameter's shape and dtype (float32), no storage."""
    with torch.device("meta"):
        return Transformer(resolve_config(preset_or_config))


def build(
    preset_or_config: str | ModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> Transformer:
    config = resolve_config(preset_or_config)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    model = build_meta(config).to_empty(device=device).to(dtype)
    init_weights(model, seed, config.initializer_range)
    model.set_activation_checkpointing(activation_checkpointing)
    model.set_compile(compile)
    return model
