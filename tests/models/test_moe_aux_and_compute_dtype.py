"""The MoE load-balancing loss (HF parity, padding excluded, no effect on the logits, gradient only
through the router probabilities) and the bf16 compute dtype (fp32 master parameters and
gradients, bitwise reproducible, activation checkpointing bitwise equal, tied weights cast once;
negative control: the bits differ from float32 compute)."""

import dataclasses

import pytest
import torch

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.models import ModelConfig, build

MOE = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    mlp_only_layers=(1,),
    max_position_embeddings=256,
    initializer_range=0.2,
)


def _tokens(seed, batch=2, seq=24, vocab=128):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _router_logits(model, tokens, doc_ids=None):
    """Each MoE layer's router logits [N, E], captured from the MoE input."""
    captured = []
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda m, args: captured.append(args[0].reshape(-1, args[0].shape[-1]) @ m.gate.weight.T)
        )
        for layer in model.layers
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(tokens, doc_ids=doc_ids)
    for hook in hooks:
        hook.remove()
    return tuple(captured)


@pytest.mark.parametrize("padded", [False, True])
def test_aux_loss_matches_hf_load_balancing_loss(padded):
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    model = build(MOE, seed=1)
    tokens = _tokens(0)
    doc_ids = None
    if padded:  # two documents in row 0, padding at the end of row 1
        doc_ids = torch.zeros_like(tokens)
        doc_ids[0, 10:] = 1
        doc_ids[1, 17:] = -1
    with torch.no_grad():
        _, aux = model(tokens, doc_ids=doc_ids, return_aux_loss=True)
    mask = None if doc_ids is None else (doc_ids >= 0).long()
    expected = qwen3_moe.load_balancing_loss_func(_router_logits(model, tokens, doc_ids), 6, 2, mask)
    assert len(_router_logits(model, tokens)) == 2  # layer 1 is dense: two MoE layers pooled
    assert aux.dtype == torch.float32 and aux.shape == ()
    torch.testing.assert_close(aux, expected.float(), rtol=1e-6, atol=1e-6)  # parity, not invariance
    assert 1.0 < float(aux) < 6.0  # k = 2 at perfect balance, up to E = 6


def test_aux_loss_changes_no_logit_and_its_gradient_flows_only_into_router_inputs():
    model = build(MOE, seed=1)
    tokens = _tokens(1)
    plain = model(tokens)
    logits, aux = model(tokens, return_aux_loss=True)
    assert_bitwise_equal(plain, logits, "logits with and without the aux loss")
    aux.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["layers.0.mlp.gate.weight"].abs().sum() > 0
    assert grads["layers.0.self_attn.q_proj.weight"].abs().sum() > 0  # upstream of the router
    assert grads["layers.0.mlp.experts.gate_proj"].abs().sum() > 0  # feeds layer 2's router
    for name in ("layers.2.mlp.experts.gate_proj", "layers.2.mlp.experts.down_proj", "norm.weight", "lm_head.weight"):
        assert grads[name] is None or not grads[name].any(), name
    dense = build(dataclasses.replace(MOE, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0))
    assert float(dense(tokens, return_aux_loss=True)[1]) == 0.0


def _step_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits, aux = model(tokens, return_aux_loss=True)
    loss = torch.log_softmax(logits.float(), -1)[..., 0].mean() + 0.01 * aux
    loss.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_compute_keeps_fp32_masters_and_is_reproducible(tie):
    config = dataclasses.replace(MOE, tie_word_embeddings=tie)
    tokens = _tokens(2)
    model = build(config, seed=3).set_compute_dtype(torch.bfloat16)
    logits, grads = _step_grads(model, tokens)
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values()) and len(grads) == len(list(model.parameters()))
    # gradients are bf16 values widened exactly (each cast's backward): no bits below bf16's mantissa
    assert all(torch.equal(g, g.bfloat16().float()) for g in grads.values())
    again_logits, again = _step_grads(build(config, seed=3).set_compute_dtype(torch.bfloat16), tokens)
    assert_bitwise_equal(logits, again_logits, "bf16 logits, second model")
    for name in grads:
        assert_bitwise_equal(grads[name], again[name], name)
    # activation checkpointing recomputes with the same casts: the same bits
    ckpt = build(config, seed=3, activation_checkpointing=True).set_compute_dtype(torch.bfloat16)
    ckpt_logits, ckpt_grads = _step_grads(ckpt, tokens)
    assert_bitwise_equal(logits, ckpt_logits, "checkpointed logits")
    for name in grads:
        assert_bitwise_equal(grads[name], ckpt_grads[name], f"checkpointed {name}")
    # negative control: float32 compute gives other bits
    fp32_logits, fp32_grads = _step_grads(build(config, seed=3), tokens)
    assert fp32_logits.dtype == torch.float32
    assert not bitwise_equal(fp32_logits.bfloat16(), logits)
    assert not bitwise_equal(
        fp32_grads["lm_head.weight" if not tie else "embed_tokens.weight"],
        grads["lm_head.weight" if not tie else "embed_tokens.weight"],
    )
    # but close: bf16 rounding (and the odd routing flip it causes) moves logits by a few percent
    error = ((fp32_logits - logits.float()).abs().mean() / fp32_logits.abs().mean()).detach()
    assert 0 < float(error) < 0.1, float(error)


def test_compute_dtype_rejects_non_float_and_compile():
    model = build(MOE)
    with pytest.raises(ValueError, match="floating dtype"):
        model.set_compute_dtype(torch.int32)
    model.set_compute_dtype(torch.bfloat16).set_compile(True)
    with pytest.raises(ValueError, match="set_compile"):
        model(_tokens(0))
