"""AdamW updates are elementwise (sharding-invariant, bitwise); the LR schedule is as documented."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.trainer.optim import OptimizerConfig, ScheduleConfig, build_optimizer, lr_at


def _run(chunks, grads, config):
    params = [torch.nn.Parameter(c.clone()) for c in chunks]
    optimizer = build_optimizer(params, config)
    for grad in grads:
        offset = 0
        for p in params:
            p.grad = grad[offset : offset + p.numel()].clone()
            offset += p.numel()
        optimizer.step()
    return torch.cat([p.detach() for p in params])


@settings(max_examples=60)
@given(numel=st.integers(2, 3000), data=st.data())
def test_sharded_update_equals_full_update_bitwise(numel, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(1, numel - 1), min_size=1, max_size=4))))
    g = torch.Generator().manual_seed(numel)
    value = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-4, 4, (numel,), generator=g) for _ in range(3)]
    bounds = [0, *cuts, numel]
    shards = [value[a:b] for a, b in zip(bounds, bounds[1:])]
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    assert_bitwise_equal(_run(shards, grads, config), _run([value], grads, config), "sharded AdamW")


@pytest.mark.control
def test_negative_control_other_gradients_change_the_update():
    value = torch.randn(100)
    grads = [torch.randn(100)]
    other = [grads[0].clone()]
    other[0][7] = -other[0][7]  # one element's gradient flips sign
    a, b = _run([value], grads, OptimizerConfig()), _run([value], other, OptimizerConfig())
    assert not bitwise_equal(a, b) and bitwise_equal(a[:7], b[:7])


def test_schedule_warmup_then_cosine_to_floor():
    opt, sched = OptimizerConfig(lr=1.0), ScheduleConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, opt, sched, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, opt, sched, 14) == 1.0
    assert lr_at(9, opt, sched, 14) == pytest.approx(0.55)
    assert lr_at(14, opt, sched, 14) == pytest.approx(0.1)
    assert lr_at(100, opt, sched, 14) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"lr": 0}, "optimizer.lr"), ({"betas": (0.9,)}, "optimizer.betas"), ({"grad_clip": -1}, "grad_clip")],
)
def test_bad_optimizer_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)
