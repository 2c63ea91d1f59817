"""Configs, presets and deterministic init: unknown presets list the known ones, inconsistent
configs fail with the field named, the tiny presets are a few million parameters and fast, real
shapes match their namesakes, and init is a pure function of (config, seed)."""

import time

import pytest
import torch

from titan_audit import models
from titan_audit.audit import assert_bitwise_equal, bitwise_equal


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError) as info:
        models.build("tiny-dnese")
    for name in models.PRESETS:
        assert name in str(info.value)


def test_build_rejects_other_types():
    with pytest.raises(ValueError, match="preset name or a ModelConfig"):
        models.build(123)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_experts": 4, "num_experts_per_tok": 0, "moe_intermediate_size": 8}, "num_experts_per_tok"),
        ({"num_experts": 4, "num_experts_per_tok": 2}, "moe_intermediate_size"),
        ({"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
        ({"mlp_only_layers": (9,)}, "mlp_only_layers"),
        ({"intermediate_size": 0}, "intermediate_size"),
    ],
)
def test_inconsistent_config_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        models.get_preset("tiny-dense").replace(**change)


def test_unknown_config_field():
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        models.get_preset("tiny-dense").replace(hidden=3)


def test_real_shape_presets_have_their_sizes():
    with torch.device("meta"):
        qwen = models.Transformer(models.get_preset("qwen3-0.6b"))
        moe = models.Transformer(models.get_preset("qwen3-moe-small"))
    assert 590e6 < qwen.num_params() < 610e6  # Qwen3-0.6B: 596M with tied embeddings
    assert 1e9 < moe.num_params() < 2.5e9
    assert all(moe.config.is_moe_layer(i) for i in range(moe.config.num_hidden_layers))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "llama-tiny"])
def test_tiny_presets_are_small_and_train_fast(preset):
    model = models.build(preset, seed=0)
    assert 1e6 < model.num_params() < 1e7
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))

    def step():
        logits = model(tokens[:, :-1])
        loss = -models.token_logprobs(logits, tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    first = step()
    start = time.perf_counter()
    second = step()
    elapsed = time.perf_counter() - start
    assert second < first
    assert elapsed < 1.0, f"{preset}: a 512-token train step took {elapsed:.2f}s"


def test_init_is_a_function_of_config_and_seed():
    config = models.get_preset("tiny-moe")
    a = models.build(config, seed=7)
    b = models.build(config, seed=7)
    c = models.build(config, seed=8)
    for (name, x), (_, y), (_, z) in zip(
        a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=True
    ):
        assert_bitwise_equal(x, y, name)
        if "norm" not in name:
            assert not bitwise_equal(x, z), f"{name} ignores the seed"
    # a parameter's values do not depend on the other parameters (keyed by name)
    deeper = models.build(config.replace(num_hidden_layers=5), seed=7)
    assert_bitwise_equal(deeper.layers[2].mlp.experts.up_proj, a.layers[2].mlp.experts.up_proj)
    # the dtype only rounds the float32 draw
    half = models.build(config, seed=7, dtype=torch.bfloat16)
    assert_bitwise_equal(half.embed_tokens.weight, a.embed_tokens.weight.to(torch.bfloat16))
    assert torch.all(a.layers[0].input_layernorm.weight == 1)
    assert abs(a.embed_tokens.weight.std().item() - config.initializer_range) < 1e-3


def test_tied_head_shares_embedding():
    model = models.build(models.get_preset("tiny-dense").replace(tie_word_embeddings=True))
    assert model.lm_head is None
    assert model.output_weight is model.embed_tokens.weight
