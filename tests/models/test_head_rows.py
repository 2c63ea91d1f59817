"""The LM head at chosen rows (`model(tokens, logits_rows=rows)`, models/head_rows.py): in BI mode
the logits and every parameter gradient are bitwise those of the full forward's rows."""

import pytest
import torch

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.models import ops

from .conftest import SMALL_DENSE

# M = B * T = 256 token rows: the v2 gemm tree splits K = 256 into 4 blocks, K = N = 100 into none,
# so a head gradient summed over the chosen rows alone has other bits (the negative control).
B, T = 4, 64
ROWS = sorted(torch.randperm(B * T, generator=torch.Generator().manual_seed(6))[:100].tolist())


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    return models.build(SMALL_DENSE.replace(tie_word_embeddings=request.param), seed=2)


def _tokens_and_upstream(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(len(ROWS), vocab, generator=torch.Generator().manual_seed(5))
    return tokens, upstream


def _run(model, chosen: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    tokens, upstream = _tokens_and_upstream(model.config.vocab_size)
    rows = torch.tensor(ROWS)
    with bi.enabled():
        if chosen:
            logits = model(tokens, logits_rows=rows)
        else:
            logits = model(tokens).reshape(B * T, -1)[rows]
        (logits * upstream).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_chosen_rows_have_the_full_heads_bits_and_gradients(model):
    logits, grads = _run(model, chosen=True)
    full_logits, full_grads = _run(model, chosen=False)
    assert logits.shape == (len(ROWS), model.config.vocab_size)
    assert_bitwise_equal(logits, full_logits)
    assert grads.keys() == full_grads.keys()
    for name in grads:
        assert_bitwise_equal(grads[name], full_grads[name])


@pytest.mark.control
def test_a_head_gradient_over_the_chosen_rows_alone_has_other_bits(model):
    # negative control: mm over K = 100 rows instead of the zero-filled K = 256 changes the bits
    _, full_grads = _run(model, chosen=False)
    tokens, upstream = _tokens_and_upstream(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    with bi.enabled():
        captured = {}
        handle = model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("x", o))
        model(tokens)
        handle.remove()
        x_ND = captured["x"].reshape(B * T, -1)[torch.tensor(ROWS)].detach()
        weight = model.output_weight.detach().requires_grad_(True)
        (ops.linear(x_ND, weight) * upstream).sum().backward()
    name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head_part = weight.grad
    if model.lm_head is None:  # the tied gradient also holds the embedding's rows: compare untouched ones
        untouched = torch.ones(model.config.vocab_size, dtype=torch.bool)
        untouched[tokens.unique()] = False
        assert not bitwise_equal(head_part[untouched], full_grads[name][untouched])
    else:
        assert not bitwise_equal(head_part, full_grads[name])


def test_logits_rows_are_checked(model):
    tokens, _ = _tokens_and_upstream(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"logits_rows must lie in \[0, 256\)"):
        model(tokens, logits_rows=torch.tensor([0, 256]))
    with pytest.raises(ValueError, match="distinct"):
        model(tokens, logits_rows=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="1-D integer"):
        model(tokens, logits_rows=torch.tensor([1.0]))
