"""HF interop: random transformers models (configs built in code, no downloads) saved with
transformers and loaded here give the same logits within float32 tolerance, and our checkpoints
load back into transformers with the same logits. Covers Qwen3 (untied and tied, GQA), Qwen3-MoE
(normalised and raw top-k, mixed dense/MoE layers) and Llama."""

import pytest
import torch
from hf_models import ATOL, COMMON, hf_model

from titan_audit import models
from titan_audit.audit import assert_bitwise_equal

transformers = pytest.importorskip("transformers")


def _compare(hf_model, ours, tokens):
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        got = ours(tokens)
    diff = (expected - got).abs().max().item()
    assert diff < ATOL, f"max abs logit diff {diff}"
    return diff


def _qwen3(tie):
    cfg = transformers.Qwen3Config(
        **COMMON,
        intermediate_size=96,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return hf_model(transformers.Qwen3ForCausalLM, cfg)


def _qwen3_moe(norm_topk_prob, mlp_only_layers=(), sparse_step=1, layers=2):
    cfg = transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": layers},
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=list(mlp_only_layers),
    )
    model = hf_model(transformers.Qwen3MoeForCausalLM, cfg)
    with torch.no_grad():  # HF inits the router at zero: make routing non-trivial
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def _llama():
    cfg = transformers.LlamaConfig(**COMMON, intermediate_size=96, rope_theta=500000.0)
    return hf_model(transformers.LlamaForCausalLM, cfg)


CASES = {
    "qwen3": lambda: _qwen3(tie=False),
    "qwen3-tied": lambda: _qwen3(tie=True),
    "qwen3-moe": lambda: _qwen3_moe(norm_topk_prob=True),
    "qwen3-moe-raw-topk-mixed": lambda: _qwen3_moe(False, mlp_only_layers=(0,), layers=3),
    "qwen3-moe-sparse-step-2": lambda: _qwen3_moe(True, sparse_step=2, layers=2),
    "llama": _llama,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_checkpoint_loads_with_matching_logits(case, tmp_path, make_tokens):
    hf_model = CASES[case]()
    hf_model.save_pretrained(tmp_path)
    ours = models.from_pretrained(tmp_path).eval()
    assert ours.embed_tokens.weight.dtype == torch.float32
    tokens = make_tokens(11, 3, 37, vocab=128)
    diff = _compare(hf_model, ours, tokens)
    print(f"{case}: max abs logit diff vs transformers {diff:.3e}")


@pytest.mark.parametrize("case", ["qwen3", "qwen3-tied", "qwen3-moe", "llama"])
def test_our_checkpoint_loads_in_transformers(case, tmp_path, make_tokens):
    hf_model = CASES[case]()
    hf_model.save_pretrained(tmp_path / "hf")
    ours = models.from_pretrained(tmp_path / "hf").eval()
    models.save_pretrained(ours, tmp_path / "ours")
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    _compare(reloaded_hf, ours, make_tokens(12, 2, 21, vocab=128))
    # and our own round trip is exact
    again = models.from_pretrained(tmp_path / "ours")
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert_bitwise_equal(a, b, name)


def test_hf_cached_generation_matches_our_paged_decode(tmp_path, make_tokens):
    """Decode through our paged cache tracks transformers' own KV-cache decode."""
    hf_model = CASES["qwen3-moe"]()
    hf_model.save_pretrained(tmp_path)
    ours = models.from_pretrained(tmp_path).eval()
    prompt = make_tokens(13, 1, 9, vocab=128)
    with torch.no_grad():
        hf_tokens = hf_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        cache = models.PagedKVCache(ours.config, num_blocks=8, block_size=4)
        cache.add("s")
        logits = ours(prompt, cache=cache.batch(["s"]))
        generated = [prompt]
        for _ in range(8):
            next_token = logits[:, -1:].argmax(-1)
            generated.append(next_token)
            logits = ours(next_token, cache=cache.batch(["s"]))
    assert torch.equal(torch.cat(generated, 1), hf_tokens)


def test_from_pretrained_dtype(tmp_path):
    _qwen3(tie=False).save_pretrained(tmp_path)
    model = models.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_parity_check_can_fail(tmp_path, make_tokens):
    """Negative control: one perturbed weight breaks the tolerance check."""
    hf_model = CASES["qwen3"]()
    hf_model.save_pretrained(tmp_path)
    ours = models.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ours.layers[1].self_attn.k_norm.weight[3] += 1e-3
    with pytest.raises(AssertionError, match="max abs logit diff"):
        _compare(hf_model, ours, make_tokens(11, 3, 37, vocab=128))


@pytest.mark.parametrize("fixture", ["dense_model", "moe_model", "moe_shared_model"])
def test_own_round_trip_is_bitwise(request, fixture, tmp_path, make_tokens):
    """save_pretrained -> from_pretrained keeps every weight and every logit bit (incl. the
    shared-expert extension and mixed dense/MoE layers)."""
    model = request.getfixturevalue(fixture)
    models.save_pretrained(model, tmp_path)
    loaded = models.from_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert_bitwise_equal(a, b, name)
    tokens = make_tokens(14, 2, 19)
    with torch.no_grad():
        assert_bitwise_equal(loaded(tokens), model(tokens), "logits after round trip")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_parity_against_hf_eager_attention_top3(family, tmp_path, make_tokens):
    """HF's eager attention (explicit softmax) and top-3 routing (HF sums experts in index order,
    we in rank order): other rounding, same model within float32 tolerance."""
    common = {**COMMON, "intermediate_size": 96}
    if family == "qwen3":
        cls, config = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    elif family == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    else:
        cls = transformers.Qwen3MoeForCausalLM
        config = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True
        )
    config._attn_implementation = "eager"
    theirs = hf_model(cls, config)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    theirs.save_pretrained(tmp_path)
    diff = _compare(theirs, models.from_pretrained(tmp_path).eval(), make_tokens(15, 3, 64, vocab=128))
    print(f"{family} vs HF eager attention: max abs logit diff {diff:.3e}")
