"""The gradient buffer pool: data parallel holds at most floor(log2(V/W)) + 2 gradient-sized
buffers per rank (the pool's peak is log2(V/W) + 1 when V/W is a power of two), allocates none
after the first step, and the reduced gradient keeps the reference tree's bits."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.trainer import reduce as reduce_module
from titan_audit.trainer import shared_exchange
from titan_audit.trainer.reduce import TreeReducer, tree_sum
from titan_audit.trainer.step import GradBuffers, StepKit


def _leaves(num_microbatches: int, numel: int, seed: int = 0) -> torch.Tensor:
    """V gradients with a wide dynamic range (the order of additions shows in the bits); none is
    -0.0, so 0 + g (how a leaf lands in its zeroed buffer) is g bitwise."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-3, 4, (num_microbatches, numel), generator=g)
    return torch.randn(num_microbatches, numel, generator=g) * scale


def _bound(num_microbatches: int, world_size: int) -> int:
    return math.floor(math.log2(num_microbatches // world_size)) + 2


def _step(reducer: TreeReducer, pool: GradBuffers, leaves: torch.Tensor) -> torch.Tensor:
    """One step's reduction as StepKit runs it: each leaf added into a zeroed buffer from the
    pool, the result cloned and given back. Returns the reduced gradient."""
    for i in range(*reducer.block):
        reducer.add(i, pool.take().add_(leaves[i]))
    reduced = reducer.all_reduce()
    out = reduced.clone()
    pool.give(reduced)
    assert pool.lent == 0
    return out


@pytest.mark.parametrize("num_microbatches", [2, 4, 8, 16])
def test_the_pool_holds_a_logarithmic_number_of_buffers_with_the_reference_bits(num_microbatches):
    leaves = _leaves(num_microbatches, 257)
    pool = GradBuffers(257)
    reducer = TreeReducer(num_microbatches, release=pool.give)
    reduced = _step(reducer, pool, leaves)
    assert_bitwise_equal(reduced, tree_sum(leaves), f"V={num_microbatches}")
    assert pool.peak == int(math.log2(num_microbatches)) + 1  # the stack's depth + the incoming leaf
    assert pool.peak <= _bound(num_microbatches, 1)
    assert pool.allocated == pool.peak


def test_negative_control_one_buffer_per_microbatch_exceeds_the_bound():
    """Without recycling (the reducer gives nothing back: a buffer per microbatch, as before the
    pool) the same count check fails at V = 16, with the same bits."""
    leaves = _leaves(16, 257)
    pool = GradBuffers(257)
    reducer = TreeReducer(16)  # no release: every buffer stays lent
    for i in range(16):
        reducer.add(i, pool.take().add_(leaves[i]))
    assert bitwise_equal(reducer.all_reduce(), tree_sum(leaves))
    assert pool.peak == 16
    assert not pool.peak <= _bound(16, 1)


def test_no_buffer_is_allocated_after_the_first_step():
    pool = GradBuffers(257)
    reducer = TreeReducer(8, release=pool.give)
    first = _step(reducer, pool, _leaves(8, 257, seed=1))
    allocated = pool.allocated
    second = _step(reducer, pool, _leaves(8, 257, seed=2))
    assert pool.allocated == allocated == 4
    assert_bitwise_equal(first, tree_sum(_leaves(8, 257, seed=1)), "step 1")
    assert_bitwise_equal(second, tree_sum(_leaves(8, 257, seed=2)), "step 2")


def test_the_pool_refuses_a_buffer_it_has_not_lent():
    pool = GradBuffers(4)
    buffer = pool.take()
    with pytest.raises(AssertionError, match="has not lent"):
        pool.give(torch.zeros(4))
    pool.give(buffer)
    with pytest.raises(AssertionError, match="has not lent"):
        pool.give(buffer)  # twice


class _Recorder:
    """The step kit's recorder calls; keeps the gradients it is shown."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def set_microbatch(self, index: int) -> None:
        pass

    def record_grads(self) -> None:
        self.grads = [p.grad.clone() for p in self.params]

    def record_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def record_params(self) -> None:
        pass


def test_the_step_kit_recycles_its_buffers_across_steps():
    """StepKit at W = 1 (no process group): leaves from the pool, spent ones and the reduced one
    given back every step, no allocation after the first, the gradient of the reference tree."""
    num_microbatches = 8
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    params = list(model.parameters())
    recorder = _Recorder()
    recorder.params = params
    config = SimpleNamespace(
        determinism=SimpleNamespace(enabled=True),
        num_microbatches=num_microbatches,
        optimizer=SimpleNamespace(grad_clip=0.0),
    )
    mesh = SimpleNamespace(dp_group=None, device=torch.device("cpu"), tp=1)
    run = SimpleNamespace(config=config, mesh=mesh, recorder=recorder)
    kit = StepKit(run, params, torch.optim.SGD(params, lr=0.0))
    allocated = []
    for step in range(2):
        inputs = torch.randn(num_microbatches, 4, 5, generator=torch.Generator().manual_seed(step))
        per_microbatch = []
        for j in range(num_microbatches):
            model.zero_grad(set_to_none=True)
            model(inputs[j]).square().sum().backward()
            per_microbatch.append(torch.cat([p.grad.reshape(-1) for p in params]))
        expected = tree_sum(torch.stack(per_microbatch))
        for j in range(num_microbatches):
            with kit.microbatch(j):
                model(inputs[j]).square().sum().backward()
        kit.finish()
        assert_bitwise_equal(torch.cat([g.reshape(-1) for g in recorder.grads]), expected, f"step {step}")
        assert kit.buffers.lent == 0
        assert kit.buffers.peak == 4 <= _bound(num_microbatches, 1)
        allocated.append(kit.buffers.allocated)
    assert allocated == [4, 4]


def _pool_on_ranks(rank, world_size, cases):
    """Two steps per case through a pooled reducer over the group, by the transport it names."""
    out = {}
    for num_microbatches, numel, transport in cases:
        os.environ[shared_exchange.ENV_SWITCH] = "1" if transport == "shared file" else "0"
        reduce_module.COLLECTIVE_MAX_BYTES = 1 << 40 if transport == "all_to_all" else 0  # this process only
        pool = GradBuffers(numel)
        reducer = TreeReducer(num_microbatches, release=pool.give)
        steps = [_step(reducer, pool, _leaves(num_microbatches, numel, seed=s)) for s in range(2)]
        assert reducer.transport == ("shared file" if transport == "shared file" else "gloo")
        out[num_microbatches, transport] = {"steps": steps, "peak": pool.peak, "allocated": pool.allocated}
    return out


@pytest.mark.slow
def test_two_ranks_hold_the_bound_with_the_reference_bits():
    """W = 2, every transport: V = 16 (blocks of 8, one subtree each: peak 4 on each rank) and
    V = 6 (blocks [0, 3) and [3, 6): peaks 2 and 3, within floor(log2 3) + 2 = 3)."""
    cases = [(v, 1001, t) for v in (16, 6) for t in ("shared file", "all_to_all", "point to point")]
    results = run_ranks(_pool_on_ranks, 2, args=(cases,))
    peaks = {16: [4, 4], 6: [2, 3]}
    for num_microbatches, numel, transport in cases:
        for rank, result in enumerate(results):
            figures = result[num_microbatches, transport]
            for s, reduced in enumerate(figures["steps"]):
                expected = tree_sum(_leaves(num_microbatches, numel, seed=s))
                assert_bitwise_equal(reduced, expected, f"V={num_microbatches} {transport} rank {rank} step {s}")
            assert figures["peak"] == peaks[num_microbatches][rank] <= _bound(num_microbatches, 2)
            assert figures["allocated"] == figures["peak"]  # none in the second step
