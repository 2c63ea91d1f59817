"""Tiny random transformers models for the HF interop tests (configs built in code, no downloads):
`hf_model(cls, config)` with its norm weights perturbed (HF starts them at 1, so a parity check
would not see them), COMMON (the shared small shape) and ATOL, the parity tolerance of logits."""

from __future__ import annotations

import torch

ATOL = 2e-5  # float32; logits here are O(1)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def hf_model(cls, config):
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model
