"""Tied embeddings in BI mode (models/tied.py): one weight-gradient pass, the plain path's bits."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu.embedding import embedding_backward
from titan_audit.models import tied
from titan_audit.models.presets import PRESETS
from titan_audit.models.transformer import Transformer


def _crafted():
    """A table whose head gradient holds -0.0 in an untouched row (an fma chain from +0.0 whose
    product underflows), which the plain path's dense add turns into +0.0."""
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    tokens = torch.tensor([[1, 3, 1, 7]])
    h = torch.full((1, 4, 4), 1e-20)
    upstream = torch.zeros(1, 4, 10)
    upstream[..., 5] = -1e-30  # row 5 of the head gradient: sums of -1e-50 -> -0.0
    upstream[..., 3] = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))  # a touched row
    return weight, tokens, h, upstream


def _weight_grad(linked: bool, weight, tokens, h, upstream):  # noqa: ANN001
    weight = weight.detach().clone().requires_grad_()
    with bi.enabled():
        link = tied.TiedLink()
        emb = tied.embedding(tokens, weight, link) if linked else F.embedding(tokens, weight)
        x = h + emb * 0.0  # the head's input depends on the embedding, as a model's does
        logits = tied.head(x, weight, link) if linked else bi.linear(x, weight)
        (logits * upstream).sum().backward()
    return weight.grad


def test_linked_gradient_equals_the_plain_path_including_signed_zeros():
    weight, tokens, h, upstream = _crafted()
    linked, plain = _weight_grad(True, weight, tokens, h, upstream), _weight_grad(False, weight, tokens, h, upstream)
    assert_bitwise_equal(linked, plain)
    assert plain[5].eq(0).all() and not torch.signbit(plain[5]).any()  # +0.0 in the plain path
    with bi.enabled():  # the head's own gradient has -0.0 there: without add_(0.0) the bits would differ
        head_only = bi.mm(upstream.reshape(-1, 10).t(), h.reshape(-1, 4))
    assert torch.signbit(head_only[5]).all()


def test_without_the_head_the_embedding_returns_its_dense_gradient():
    weight, tokens, _, _ = _crafted()
    grad_h = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(2))
    w = weight.detach().clone().requires_grad_()
    with bi.enabled():
        (tied.embedding(tokens, w, tied.TiedLink()) * grad_h).sum().backward()
    assert_bitwise_equal(w.grad, embedding_backward(grad_h, tokens, 10))


@pytest.fixture(scope="module")
def tied_model():
    config = dataclasses.replace(PRESETS["tiny-dense"], tie_word_embeddings=True, num_hidden_layers=2)
    return models.build(config, seed=3)


def _model_grads(model: Transformer, linked: bool, monkeypatch) -> dict[str, torch.Tensor]:  # noqa: ANN001
    monkeypatch.setattr(Transformer, "_links_tied_grads", lambda self, cast: linked and cast is None)
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(4))
    upstream = torch.randn(3, 24, model.config.vocab_size, generator=torch.Generator().manual_seed(5))
    with bi.enabled():
        (model(tokens) * upstream).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_tied_model_has_the_plain_paths_gradients(tied_model, monkeypatch):
    linked = _model_grads(tied_model, True, monkeypatch)
    plain = _model_grads(tied_model, False, monkeypatch)
    assert linked.keys() == plain.keys()
    for name in linked:
        assert_bitwise_equal(linked[name], plain[name])
    # control: the comparison sees a one-ulp change in one element of the tied gradient
    changed = plain["embed_tokens.weight"].clone()
    changed.view(-1)[7] = torch.nextafter(changed.view(-1)[7], torch.tensor(float("inf")))
    assert not bitwise_equal(linked["embed_tokens.weight"], changed)
