"""Deterministic tree reduction: the reduced gradient has the same bits for every W dividing V."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distributed import run_ranks
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.trainer.reduce import TreeReducer, block_subtrees, rank_block, split_point, tree_nodes


def _leaves(num_microbatches: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # wide dynamic range so that the order of additions shows in the bits
    return [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g) for _ in range(num_microbatches)]


def _reference_tree_sum(leaves, lo, hi):
    if hi - lo == 1:
        return leaves[lo].clone()
    mid = split_point(lo, hi)
    return _reference_tree_sum(leaves, lo, mid) + _reference_tree_sum(leaves, mid, hi)


@pytest.mark.parametrize("n, left", [(2, 1), (3, 2), (5, 4), (6, 4), (8, 4), (12, 8), (16, 8)])
def test_split_point_puts_a_power_of_two_on_the_left(n, left):
    assert split_point(10, 10 + n) == 10 + left


@given(st.integers(1, 64), st.data())
def test_block_subtrees_tile_the_block_with_tree_nodes(num_leaves, data):
    start = data.draw(st.integers(0, num_leaves - 1))
    stop = data.draw(st.integers(start + 1, num_leaves))
    nodes = block_subtrees(num_leaves, start, stop)
    assert nodes[0][0] == start and nodes[-1][1] == stop
    assert all(a[1] == b[0] for a, b in zip(nodes, nodes[1:]))
    assert set(nodes) <= tree_nodes(num_leaves)


@given(st.sampled_from([1, 2, 3, 4, 5, 6, 8, 12, 16]), st.integers(1, 40))
def test_local_streaming_merge_equals_the_reference_tree(num_microbatches, numel):
    leaves = _leaves(num_microbatches, numel)
    reducer = TreeReducer(num_microbatches)
    for i, leaf in enumerate(leaves):
        reducer.add(i, leaf.clone())
    assert_bitwise_equal(reducer.all_reduce(), _reference_tree_sum(leaves, 0, num_microbatches))


def test_out_of_order_and_early_reduce_are_errors():
    reducer = TreeReducer(4)
    with pytest.raises(ValueError, match="out of order"):
        reducer.add(1, torch.zeros(3))
    reducer.add(0, torch.zeros(3))
    with pytest.raises(ValueError, match="reduce called after"):
        reducer.all_reduce()


def test_world_size_must_divide_microbatches():
    with pytest.raises(ValueError, match="world size 3 must divide .* 8"):
        rank_block(8, 3, 0)


def _reduce_on_ranks(rank, world_size, num_microbatches, numel):
    leaves = _leaves(num_microbatches, numel)
    reducer = TreeReducer(num_microbatches)
    start, stop = reducer.block
    for i in range(start, stop):
        reducer.add(i, leaves[i].clone())
    full = reducer.all_reduce()
    for i in range(start, stop):
        reducer.add(i, leaves[i].clone())
    chunk, c_start, c_stop = reducer.reduce_scatter()

    # the usual way, for the negative control: sequential local sum, then all_reduce
    naive = leaves[start].clone()
    for i in range(start + 1, stop):
        naive += leaves[i]
    torch.distributed.all_reduce(naive)
    return {"full": full, "chunk": chunk, "range": (c_start, c_stop), "naive": naive}


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatches, world_sizes", [(8, (1, 2, 4)), (6, (1, 2, 3))])
def test_reduction_is_bitwise_identical_for_every_world_size(num_microbatches, world_sizes):
    numel = 1001  # not a multiple of any W: exercises chunk padding
    leaves = _leaves(num_microbatches, numel)
    expected = _reference_tree_sum(leaves, 0, num_microbatches)
    naive_results = []
    for world_size in world_sizes:
        results = run_ranks(_reduce_on_ranks, world_size, args=(num_microbatches, numel))
        for rank, result in enumerate(results):
            assert_bitwise_equal(result["full"], expected, f"W={world_size} rank {rank} all_reduce")
            start, stop = result["range"]
            assert_bitwise_equal(result["chunk"], expected[start:stop], f"W={world_size} rank {rank} chunk")
        assert sum(r["range"][1] - r["range"][0] for r in results) == numel
        naive_results.append(results[0]["naive"])
    # negative control: plain local accumulation + all_reduce does depend on W
    assert not all(bitwise_equal(naive_results[0], other) for other in naive_results[1:])
