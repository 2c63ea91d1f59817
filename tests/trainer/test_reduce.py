"""Deterministic tree reduction: the reduced gradient has the same bits for every W dividing V."""

import os

import pytest
import torch
from distributed import run_ranks
from hypothesis import given
from hypothesis import strategies as st

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.trainer import reduce as reduce_module
from titan_audit.trainer import shared_exchange
from titan_audit.trainer.reduce import (
    TreeReducer,
    block_subtrees,
    chunk_bounds,
    rank_block,
    split_point,
    tree_nodes,
)


def _leaves(num_microbatches: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # wide dynamic range so that the order of additions shows in the bits
    return [
        torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
        for _ in range(num_microbatches)
    ]


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


def test_gradients_of_one_reduction_must_match_in_shape_and_dtype():
    reducer = TreeReducer(4)
    reducer.add(0, torch.zeros(3))
    with pytest.raises(ValueError, match="microbatch 1: gradient torch.float64"):
        reducer.add(1, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="microbatch 1: gradient torch.float32\\[4\\]"):
        reducer.add(1, torch.zeros(4))


@given(st.integers(0, 50), st.integers(1, 9))
def test_chunk_bounds_tile_the_vector_in_rank_order(numel, world_size):
    bounds = chunk_bounds(numel, world_size)
    assert len(bounds) == world_size and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(bounds, bounds[1:]))
    assert max(hi - lo for lo, hi in bounds) == -(-numel // world_size)


def test_world_size_must_divide_microbatches():
    with pytest.raises(ValueError, match="world size 3 must divide .* 8"):
        rank_block(8, 3, 0)


def _reduce_on_ranks(rank, world_size, num_microbatches, numel):
    leaves = _leaves(num_microbatches, numel)
    reducer = TreeReducer(num_microbatches)
    start, stop = reducer.block
    first = leaves[start].clone()
    reducer.add(start, first)
    for i in range(start + 1, stop):
        reducer.add(i, leaves[i].clone())
    full = reducer.all_reduce()
    assert full.data_ptr() == first.data_ptr()  # documented: the result is in the first buffer added
    for i in range(start, stop):
        reducer.add(i, leaves[i].clone())
    chunk, c_start, c_stop = reducer.reduce_scatter()

    # the usual way, for the negative control: sequential local sum, then all_reduce
    naive = leaves[start].clone()
    for i in range(start + 1, stop):
        naive += leaves[i]
    torch.distributed.all_reduce(naive)
    return {"full": full, "chunk": chunk, "range": (c_start, c_stop), "naive": naive}


def _reduce_rounds_on_ranks(rank, world_size, num_microbatches, sizes, collective_max_bytes, shared):
    """Several reductions through one reducer (its scratch buffers are reused or regrown), over
    gloo (`collective_max_bytes` picks its path) or the same-host shared file."""
    reduce_module.COLLECTIVE_MAX_BYTES = collective_max_bytes  # this spawned process only
    os.environ[shared_exchange.ENV_SWITCH] = "1" if shared else "0"
    reducer = TreeReducer(num_microbatches)
    start, stop = reducer.block
    out = []
    for round_, numel in enumerate(sizes):
        leaves = _leaves(num_microbatches, numel, seed=round_)
        for i in range(start, stop):
            reducer.add(i, leaves[i].clone())
        if round_ % 2:
            out.append(("chunk", *reducer.reduce_scatter(), reducer.transport == "shared file"))
        else:
            out.append(("full", reducer.all_reduce().clone(), 0, numel, reducer.transport == "shared file"))
    return out


def _jobs_on_ranks(rank, world_size, num_microbatches, jobs):
    """Several reductions one after the other in the same ranks (process start-up dominates their
    cost), each with its own reducer and from the process's own settings: ("tree", numel) is
    `_reduce_on_ranks`, ("rounds", sizes, collective_max_bytes, shared) `_reduce_rounds_on_ranks`."""
    collective_max_bytes, switch = reduce_module.COLLECTIVE_MAX_BYTES, os.environ.get(shared_exchange.ENV_SWITCH)
    out = []
    for kind, *args in jobs:
        fn = {"tree": _reduce_on_ranks, "rounds": _reduce_rounds_on_ranks}[kind]
        out.append(fn(rank, world_size, num_microbatches, *args))
        reduce_module.COLLECTIVE_MAX_BYTES = collective_max_bytes
        if switch is None:
            os.environ.pop(shared_exchange.ENV_SWITCH, None)
        else:
            os.environ[shared_exchange.ENV_SWITCH] = switch
    return out


TREE_NUMEL = 1001  # not a multiple of any W: exercises chunk padding
TREE_WORLD_SIZES = {8: (1, 2, 4), 6: (1, 2, 3)}  # num_microbatches: the world sizes compared
ROUND_SIZES = [1, 3, 7, 1001, 5, 4096 + 3]  # below W (empty chunks), not divisible by W, growing and shrinking
PATHS = [("point to point", 0, False), ("all_to_all", 1 << 40, False), ("shared memory", 0, True)]
ROUND_LAYOUTS = [(8, 2), (8, 4), (6, 2), (6, 3)]


@pytest.fixture(scope="module")
def launches():
    """`launches(num_microbatches, world_size)`: one process group per layout runs every job of this
    module at that layout (the tree reduction, then the rounds over each transport), launched once,
    at its first use: {"tree": ranks' results, path: ranks' results}."""
    done = {}

    def get(num_microbatches, world_size):
        if (num_microbatches, world_size) not in done:
            jobs = [("tree", TREE_NUMEL)]
            if (num_microbatches, world_size) in ROUND_LAYOUTS:
                jobs += [("rounds", ROUND_SIZES, max_bytes, shared) for _, max_bytes, shared in PATHS]
            results = run_ranks(_jobs_on_ranks, world_size, args=(num_microbatches, jobs))
            names = ["tree"] + [path for path, _, _ in PATHS][: len(jobs) - 1]
            done[num_microbatches, world_size] = {name: [r[i] for r in results] for i, name in enumerate(names)}
        return done[num_microbatches, world_size]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatches, world_sizes", list(TREE_WORLD_SIZES.items()))
def test_reduction_is_bitwise_identical_for_every_world_size(num_microbatches, world_sizes, launches):
    numel = TREE_NUMEL
    leaves = _leaves(num_microbatches, numel)
    expected = _reference_tree_sum(leaves, 0, num_microbatches)
    naive_results = []
    for world_size in world_sizes:
        results = launches(num_microbatches, world_size)["tree"]
        for rank, result in enumerate(results):
            assert_bitwise_equal(result["full"], expected, f"W={world_size} rank {rank} all_reduce")
            start, stop = result["range"]
            assert_bitwise_equal(result["chunk"], expected[start:stop], f"W={world_size} rank {rank} chunk")
        assert sum(r["range"][1] - r["range"][0] for r in results) == numel
        naive_results.append(results[0]["naive"])
    # negative control: plain local accumulation + all_reduce does depend on W
    assert not all(bitwise_equal(naive_results[0], other) for other in naive_results[1:])


@pytest.mark.slow
@pytest.mark.parametrize("path, collective_max_bytes, shared", PATHS)
@pytest.mark.parametrize("num_microbatches, world_size", ROUND_LAYOUTS)
def test_reductions_of_any_size_repeat_bitwise(
    num_microbatches, world_size, path, collective_max_bytes, shared, launches
):
    """Several reductions through one reducer, of sizes below W (empty chunks), not divisible by W,
    growing and shrinking between calls, over `path`, have the reference tree's bits on every rank
    and used that transport."""
    sizes = ROUND_SIZES
    results = launches(num_microbatches, world_size)[path]
    for round_, numel in enumerate(sizes):
        expected = _reference_tree_sum(_leaves(num_microbatches, numel, seed=round_), 0, num_microbatches)
        covered = 0
        for rank, rounds in enumerate(results):
            _, value, start, stop, used_shared = rounds[round_]
            assert_bitwise_equal(value, expected[start:stop], f"{path} W={world_size} rank {rank} numel {numel}")
            assert used_shared == shared, f"{path}: rank {rank} took the other transport"
            covered += stop - start
        assert covered == (numel if round_ % 2 else numel * world_size)


def _partials_on_ranks(rank, world_size, numels):
    """Each rank's partial is leaf `rank`; the fixed-order sum by both transports."""
    out = {}
    for transport, gather_max_bytes in (("all-gather", 1 << 30), ("tree-reducer", 0)):
        reduce_module.PARTIALS_GATHER_MAX_BYTES = gather_max_bytes  # this spawned process only
        for numel in numels:
            partial = _leaves(world_size, numel, seed=numel)[rank].clone().view(-1, 1)
            out[transport, numel] = reduce_module.all_reduce_partials(partial)
    return out


def test_partials_reduce_in_the_tree_over_the_rank_index():
    """The TP partial sums: bitwise the halving tree over ranks, on every rank, by either transport;
    negative control: the sequential sum of the same four partials has other bits."""
    numels = [1, 1001, 40000]
    results = run_ranks(_partials_on_ranks, 4, args=(numels,))
    for (transport, numel), _ in results[0].items():
        expected = _reference_tree_sum(_leaves(4, numel, seed=numel), 0, 4).view(-1, 1)
        for rank, result in enumerate(results):
            assert_bitwise_equal(result[transport, numel], expected, f"{transport} numel {numel} rank {rank}")
    leaves = _leaves(4, 40000, seed=40000)
    sequential = ((leaves[0] + leaves[1]) + leaves[2]) + leaves[3]
    assert not bitwise_equal(sequential.view(-1, 1), results[0]["all-gather", 40000])


def _shared_file_on_ranks(rank, world_size, shm_dir):
    shared_exchange.SHM_DIR = shm_dir  # this spawned process only
    os.environ[shared_exchange.ENV_SWITCH] = "1"
    reducer = TreeReducer(4)
    leaves = _leaves(4, 1001, seed=7)
    for i in range(*reducer.block):
        reducer.add(i, leaves[i].clone())
    return reducer.all_reduce(), reducer.transport == "shared file"


@pytest.mark.parametrize("usable", [True, False], ids=["shared file", "no shared file"])
def test_the_shared_file_is_gone_once_mapped_and_without_one_gloo_gives_the_same_bits(tmp_path, usable):
    """With a usable SHM_DIR both ranks map one file, which is unlinked at once; where none can be
    made (a plain file stands where the directory should be) both ranks take gloo. The same bits
    either way; negative control: the sequential sum has other bits."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir() if usable else shm_dir.write_text("")
    expected = _reference_tree_sum(_leaves(4, 1001, seed=7), 0, 4)
    for rank, (full, used_shared) in enumerate(run_ranks(_shared_file_on_ranks, 2, args=(str(shm_dir),))):
        assert_bitwise_equal(full, expected, f"usable={usable} rank {rank}")
        assert used_shared == usable, f"rank {rank} took the other transport"
    if usable:
        assert list(shm_dir.iterdir()) == []
    leaves = _leaves(4, 1001, seed=7)
    assert not bitwise_equal(((leaves[0] + leaves[1]) + leaves[2]) + leaves[3], expected)


def test_a_rank_maps_only_rank_zeros_file(tmp_path, monkeypatch):
    """A rank maps the broadcast path only when it finds rank 0's nonce there: a missing file (two
    hosts with one identity, each its own /dev/shm) or another file's bytes make it refuse, so
    the group falls back to gloo instead of summing an empty file's zeros."""
    monkeypatch.setattr(shared_exchange, "SHM_DIR", str(tmp_path))
    path, nonce = shared_exchange._create(1024)
    assert os.path.getsize(path) == 1024 and shared_exchange._holds(path, nonce)
    assert not shared_exchange._holds(path, bytes(len(nonce)))  # control: other bytes
    assert not shared_exchange._holds(str(tmp_path / "elsewhere"), nonce)
    monkeypatch.setattr(shared_exchange, "SHM_DIR", str(tmp_path / "not-a-directory"))
    (tmp_path / "not-a-directory").write_text("")
    assert shared_exchange._create(1024) is None


def _switch_on_rank_zero_only(rank, world_size):
    os.environ[shared_exchange.ENV_SWITCH] = "0" if rank == 0 else "1"
    reducer = TreeReducer(4)
    leaves = _leaves(4, 1001, seed=3)
    for i in range(*reducer.block):
        reducer.add(i, leaves[i].clone())
    return reducer.all_reduce(), reducer.transport


def test_ranks_with_different_switches_agree_on_gloo():
    """TITAN_AUDIT_SHARED_EXCHANGE=0 on one rank only: both ranks take gloo (deciding apart would
    leave one rank waiting in a collective the other never joins), with the reference bits."""
    expected = _reference_tree_sum(_leaves(4, 1001, seed=3), 0, 4)
    for rank, (full, transport) in enumerate(run_ranks(_switch_on_rank_zero_only, 2)):
        assert_bitwise_equal(full, expected, f"rank {rank}")
        assert transport == "gloo", f"rank {rank}: {transport}"
