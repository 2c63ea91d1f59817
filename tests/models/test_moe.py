"""MoE routing and expert compute: top-k ties go to the lower expert index, routing is dropless,
grouping tokens by expert matches per-token compute, and in BI mode a token's MoE output is
bitwise independent of the other tokens. Negative controls, in BI mode, each a difference the test
constructs: a token alone with the linears in another order of the sum (two BI gemms over a K cut
in two) has other bits than in the batch, and so does a token under a SiLU that depends on the
row's position (the last row's inputs moved one ulp), the property pointwise.silu exists for."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant import enabled
from titan_audit.models import init, pointwise
from titan_audit.models.moe import MoE, route

from .conftest import linears_in_another_order


def _moe(hidden=36, shared=0, norm=True, seed=0):
    """Expert width 36: not a multiple of the SIMD width, so pointwise tails occur."""
    moe = MoE(64, num_experts=5, top_k=2, hidden_dim=hidden, norm_topk_prob=norm, shared_hidden_dim=shared)
    init.init_weights(moe, seed, 0.1)
    return moe.eval()


@pytest.fixture(scope="module")
def moe():
    return _moe(shared=20)


def test_route_breaks_ties_by_expert_index():
    probs = torch.tensor(
        [
            [0.1, 0.3, 0.3, 0.3],
            [0.25, 0.25, 0.25, 0.25],
            [0.4, 0.1, 0.4, 0.1],
            [0.1, 0.2, 0.3, 0.4],
        ]
    )
    values, experts = route(probs, 2)
    assert experts.tolist() == [[1, 2], [0, 1], [0, 2], [3, 2]]
    assert torch.equal(values, probs.gather(1, experts))


def _reference(moe, x_ND):
    """Per token, per selected expert, in plain torch (no grouping)."""
    probs = torch.softmax(F.linear(x_ND, moe.gate.weight).float(), -1)
    weights, experts = route(probs, moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for j in range(moe.top_k):
            e = int(experts[n, j])
            w = moe.experts
            h = F.silu(x_ND[n] @ w.gate_proj[e].T) * (x_ND[n] @ w.up_proj[e].T)
            out[n] += weights[n, j] * (h @ w.down_proj[e].T)
        if moe.shared_expert is not None:
            s = moe.shared_expert
            h = F.silu(x_ND[n] @ s.gate_proj.weight.T) * (x_ND[n] @ s.up_proj.weight.T)
            out[n] += torch.sigmoid(x_ND[n] @ moe.shared_expert_gate.weight.T) * (h @ s.down_proj.weight.T)
    return out


@pytest.mark.parametrize("shared, norm", [(0, True), (20, False)])
@torch.no_grad()
def test_grouped_experts_match_per_token_reference(shared, norm):
    moe = _moe(shared=shared, norm=norm, seed=1)
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), _reference(moe, x.reshape(-1, 64)).view(2, 13, 64), atol=1e-5, rtol=0)


@torch.no_grad()
def test_dropless_every_token_gets_k_experts_even_if_all_pick_one():
    moe = _moe(seed=2)
    moe.gate.weight.zero_()
    moe.gate.weight[3, 0] = 10.0  # every token with x[0] > 0 strongly prefers expert 3
    x = torch.randn(1, 50, 64, generator=torch.Generator().manual_seed(2)).abs()
    torch.testing.assert_close(moe(x)[0], _reference(moe, x[0]), atol=1e-5, rtol=0)


@settings(max_examples=15)
@given(num_tokens=st.integers(2, 60), pick=st.data())
@torch.no_grad()
def test_token_output_independent_of_other_tokens_in_bi_mode(moe, num_tokens, pick):
    x = torch.randn(1, num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    subset = sorted(pick.draw(st.sets(st.integers(0, num_tokens - 1), min_size=1)))
    with enabled():
        everything = moe(x)[0]
        some = moe(x[:, subset])[0]
    assert_bitwise_equal(some, everything[subset], "MoE rows for a token subset")


def _tokens_alone_differing(moe, x):
    """How many of x's tokens have other bits alone than in the batch of all (BI mode)."""
    with enabled():
        everything = moe(x)[0]
        return sum(not bitwise_equal(moe(x[:, i : i + 1])[0, 0], everything[i]) for i in range(x.shape[1]))


@pytest.mark.control
@torch.no_grad()
def test_negative_control_token_alone_in_another_order_differs(moe, monkeypatch):
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(0))
    with enabled():
        everything = moe(x)[0]
        with linears_in_another_order(monkeypatch):
            alone = [moe(x[:, i : i + 1])[0, 0] for i in range(40)]
    assert sum(not bitwise_equal(a, everything[i]) for i, a in enumerate(alone)) > 0


@pytest.mark.control
@torch.no_grad()
def test_negative_control_a_position_dependent_silu_breaks_bi_mode(moe, monkeypatch):
    """Why pointwise.silu is position independent: with a SiLU whose last row's inputs are moved
    one ulp (as a vectorised kernel with a scalar tail computes the tail another way), a token
    alone (the last row of each expert it reaches) has other bits than in the batch."""
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(0))
    assert _tokens_alone_differing(moe, x) == 0
    silu = pointwise.silu
    up = torch.tensor(torch.inf)
    monkeypatch.setattr(pointwise, "silu", lambda t: silu(torch.cat([t[:-1], torch.nextafter(t[-1:], up)])))
    assert _tokens_alone_differing(moe, x) > 0


def test_moe_backward_flows_to_router_and_experts():
    moe = _moe(shared=20, seed=3).train()
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    moe(x).square().sum().backward()
    for name, param in moe.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
