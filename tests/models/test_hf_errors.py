"""Bad checkpoints and bad save targets fail with one clear ValueError naming the file/key;
saving is atomic and never overwrites silently."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_audit import models

CONFIG = models.ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=48,
    num_experts=3,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    models.save_pretrained(models.build(CONFIG, seed=0), path)
    return path


def _edit_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _edit_config(path, edit):
    data = json.loads((path / "config.json").read_text())
    edit(data)
    (path / "config.json").write_text(json.dumps(data))


def test_missing_extra_and_misshaped_tensors_reported_together(checkpoint):
    def edit(t):
        del t["model.layers.1.mlp.experts.2.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.extra.weight"] = torch.zeros(3)
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 31)

    _edit_weights(checkpoint, edit)
    with pytest.raises(ValueError) as info:
        models.from_pretrained(checkpoint)
    message = str(info.value)
    assert str(checkpoint / "model.safetensors") in message
    assert "missing tensors (2): model.layers.1.mlp.experts.2.up_proj.weight, model.norm.weight" in message
    assert "unexpected tensors (1): model.layers.0.extra.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight: expected [16, 32], found [16, 31]" in message


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "num_experts_per_tok"])
def test_missing_config_key_named(checkpoint, key):
    _edit_config(checkpoint, lambda d: d.pop(key))
    with pytest.raises(ValueError, match=rf"config\.json: missing config key '{key}'"):
        models.from_pretrained(checkpoint)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ],
)
def test_unsupported_or_inconsistent_config(checkpoint, change, match):
    _edit_config(checkpoint, lambda d: d.update(change))
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(checkpoint)


def test_no_weights_or_no_config(tmp_path, checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        models.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="config.json: not found"):
        models.from_pretrained(tmp_path / "nowhere")


def test_corrupt_safetensors_named(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors: cannot read safetensors"):
        models.from_pretrained(checkpoint)


def test_sharded_checkpoint_loads(tmp_path, checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((checkpoint / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, sharded / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = models.from_pretrained(checkpoint), models.from_pretrained(sharded)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_save_refuses_non_empty_target_unless_overwrite(checkpoint):
    model = models.build(CONFIG, seed=1)
    before = (checkpoint / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="not empty; pass overwrite=True"):
        models.save_pretrained(model, checkpoint)
    assert (checkpoint / "model.safetensors").read_bytes() == before
    (checkpoint / "model.safetensors.index.json").write_text("{}")  # a stale file of an old layout
    models.save_pretrained(model, checkpoint, overwrite=True)
    assert (checkpoint / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", "model.safetensors"]
    loaded = models.from_pretrained(checkpoint)
    assert torch.equal(loaded.norm.weight, model.norm.weight)


def test_save_into_empty_dir_and_to_file_target(tmp_path):
    model = models.build(CONFIG, seed=1)
    (tmp_path / "empty").mkdir()
    models.save_pretrained(model, tmp_path / "empty")  # empty directory is fine
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        models.save_pretrained(model, tmp_path / "afile")


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    """A crash while writing the weights leaves no partial file and no temporary behind."""
    import titan_audit.models.hf as hf

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", failing_save)
    target = tmp_path / "ckpt"
    with pytest.raises(OSError, match="disk full"):
        models.save_pretrained(models.build(CONFIG, seed=0), target)
    assert list(target.iterdir()) == []


def test_tied_checkpoint_with_lm_head(tmp_path):
    config = CONFIG.replace(tie_word_embeddings=True)
    model = models.build(config, seed=0)
    models.save_pretrained(model, tmp_path / "c")
    weights = load_file(tmp_path / "c" / "model.safetensors")
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "c" / "model.safetensors")
    models.from_pretrained(tmp_path / "c")  # equal copy: accepted
    weights["lm_head.weight"][0, 0] += 1.0
    save_file(weights, tmp_path / "c" / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        models.from_pretrained(tmp_path / "c")
