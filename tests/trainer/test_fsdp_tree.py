"""FSDP2's sharded tree (trainer/fsdp.py): each rank's reduced shard has the bits of the canonical
tree over the V microbatch gradients (the DP result), with at most floor(log2(V/W)) + 1 shard
partials per group; and the clip norm's order v2 (trainer/grad_norm.py) from pieces."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from titan_audit.trainer import grad_norm
from titan_audit.trainer.fsdp import _Group, shard_model
from titan_audit.trainer.reduce import TreeStack, split_point

V = 8


class _Blocks(nn.Module):
    """Decoder-like: `layers` (what shard_model wraps one by one) and a root parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 12)])
        self.head = nn.Linear(12, 5)  # 5 rows: uneven dim-0 shards at W = 2 and 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _batch(index: int) -> torch.Tensor:
    return _wide((3, 12), 100 + index)


def _loss(model: nn.Module, index: int) -> torch.Tensor:
    return (model(_batch(index)) ** 2).sum()


def _sharded_grads(rank: int, world_size: int, interleaved: bool, V: int = V) -> tuple[dict, int]:
    from torch.distributed.device_mesh import init_device_mesh

    model = _Blocks()
    tree = shard_model(model, mesh=init_device_mesh("cpu", (world_size,)))
    per_rank = V // world_size
    indices = range(rank, V, world_size) if interleaved else range(rank * per_rank, (rank + 1) * per_rank)
    tree.start_step(V)
    for index in indices:
        _loss(model, index).backward()
        model.zero_grad(set_to_none=True)
    tree.finish()
    dist.barrier()
    grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    return grads, max(group.peak for group in tree.groups)


def _reference(V: int = V) -> dict[str, torch.Tensor]:
    """DP: every microbatch's gradient as 0 + g, summed by the canonical tree."""
    model = _Blocks()
    leaves = []
    for index in range(V):
        model.zero_grad(set_to_none=True)
        _loss(model, index).backward()
        leaves.append({n: torch.zeros_like(p) + p.grad for n, p in model.named_parameters()})

    def tree(lo: int, hi: int) -> dict[str, torch.Tensor]:
        if hi - lo == 1:
            return leaves[lo]
        mid = split_point(lo, hi)
        left, right = tree(lo, mid), tree(mid, hi)
        return {n: left[n] + right[n] for n in left}

    return tree(0, V)


def _gathered(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([grads[name] for grads in per_rank]) for name in per_rank[0]}


def _bits_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_tree_has_the_dp_bits_with_log_partials(world_size):
    reference = _reference()
    results = run_ranks(_sharded_grads, world_size, args=(True,))
    assert _bits_equal(_gathered([grads for grads, _ in results]), reference)
    assert max(peak for _, peak in results) <= int(math.log2(V // world_size)) + 1
    if world_size == 2:
        # control: the same exchange over microbatches assigned in blocks sums in another order
        blocks = run_ranks(_sharded_grads, world_size, args=(False,))
        assert not _bits_equal(_gathered([grads for grads, _ in blocks]), reference)


def test_a_world_size_not_a_power_of_two_keeps_the_bits_with_a_deeper_stack():
    results = run_ranks(_sharded_grads, 3, args=(True, 6))  # V = 6: rounds {0,1,2}, {3,4,5}
    assert _bits_equal(_gathered([grads for grads, _ in results]), _reference(6))
    assert max(peak for _, peak in results) == 2  # [0,2) and [2,3) wait for round 1


@pytest.mark.control
def test_the_root_plus_zero_has_the_bits_of_zero_plus_g_leaves():
    # leaves of signed zeros and a few values, as a sparse gradient gives them
    rng = np.random.default_rng(7)
    choices = np.array([-0.0, 0.0, 1.5, -2.25], dtype=np.float32)
    leaves = [torch.from_numpy(rng.choice(choices, size=(1, 256), p=[0.55, 0.25, 0.1, 0.1])) for _ in range(V)]
    normalised = TreeStack(V)  # DP: each leaf is 0 + g
    for leaf in leaves:
        normalised.push(leaf[0] + 0.0)
    expected = normalised.take()[0][2]
    group = _Group("g", [], 1)
    group.stack = TreeStack(V, 0, group.give)
    for leaf in leaves:
        group.push_round(leaf.clone())
    assert torch.equal(group.root().view(torch.int32), expected.view(torch.int32))
    raw = TreeStack(V)  # control: the raw leaves' root without the + 0.0 keeps some -0.0
    for leaf in leaves:
        raw.push(leaf[0].clone())
    raw_root = raw.take()[0][2]
    assert not torch.equal(raw_root.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(raw_root, expected)  # they differ only in the sign of zeros


def _wide(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Wide dynamic range (the order of additions shows in the bits), from numpy's generator: the
    same values whatever ATen kernel torch's own sampler would dispatch to on this CPU."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, shape)
    return torch.from_numpy(values.astype(np.float32))


@pytest.mark.parametrize("shards", [2, 4])
def test_a_rows_tensor_parallel_column_shards_combine_to_its_sum(shards):
    g = _wide((6, 1024), 1)  # P(1024) = 16 blocks of 64
    whole = grad_norm._row_sums(g, 1024, 1)
    parts = [grad_norm._row_sums(piece, 1024, shards) for piece in g.chunk(shards, dim=1)]
    assert torch.equal(grad_norm.tree_combine(parts).view(torch.int32), whole.view(torch.int32))


@pytest.mark.control
def test_a_split_off_the_row_blocks_gives_other_bits():
    g = _wide((6, 1024), 1)
    whole = grad_norm._row_sums(g, 1024, 1)
    cut = 1024 // 2 + 1  # not a block boundary: each half summed whole, then added
    halves = grad_norm._row_sums(g[:, :cut], cut, 1) + grad_norm._row_sums(g[:, cut:], 1024 - cut, 1)
    assert not torch.equal(halves.view(torch.int32), whole.view(torch.int32))


def test_norm_v2_and_v1_are_different_orders_of_the_same_norm():
    grads = [_wide((64, 256), 2), _wide((256,), 3)]
    v2 = grad_norm.norm_v2([grad_norm.Piece(g) for g in grads])
    v1 = grad_norm.full_norm_v1(torch.cat([g.reshape(-1) for g in grads]))
    assert torch.isclose(v1, v2, rtol=1e-5)  # the same quantity ...
    assert not torch.equal(v1.view(torch.int32), v2.view(torch.int32))  # ... in another order


@pytest.mark.parametrize("rows, world", [(5, 2), (5, 4), (2, 4), (12, 3), (0, 2)])
def test_chunk_sizes_are_torch_chunks(rows, world):
    expected = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
    sizes = grad_norm.chunk_sizes(rows, world)
    assert len(sizes) == world and sizes[: len(expected)] == expected and sum(sizes) == rows


class _Deep(nn.Module):
    """Many small layers: a full gradient is many times one layer's (what FSDP2 unshards at once)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(128, 128) for _ in range(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _step_transient_bytes(rank: int, world_size: int, gather_full: bool) -> int:
    """Peak live bytes of the second step above what was live when it began, on this rank.
    gather_full: the step also makes the full flat gradient, as the gather of norm order v1 (and
    the per-microbatch flat vector before the sharded tree) did."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_audit.live_bytes import LiveBytes

    with LiveBytes() as tracker:
        model = _Deep()
        tree = shard_model(model, mesh=init_device_mesh("cpu", (world_size,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            if step == 1:
                base = tracker.live["cpu"]
                tracker.peak["cpu"] = base
            tree.start_step(V)
            for index in range(rank, V, world_size):
                (model(_batch(index)[:, :1].expand(3, 128).contiguous()) ** 2).sum().backward()
                model.zero_grad(set_to_none=True)
            tree.finish()
            if gather_full:
                torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
            optimizer.step()
            model.zero_grad(set_to_none=True)
        return tracker.peak["cpu"] - base


def _both_steps(rank: int, world_size: int) -> tuple[int, int]:
    return _step_transient_bytes(rank, world_size, False), _step_transient_bytes(rank, world_size, True)


@pytest.mark.slow  # four ranks, two models each: ~30 s on 2 shared cores
def test_a_sharded_step_never_holds_a_full_gradient():
    """Live tensor bytes (titan_audit/live_bytes.py) of a whole FSDP2 step at W = 4, V = 8, above
    the parameters and optimizer state: below one full fp32 gradient. Control: the same step that
    also gathers the full gradient (the old path's vector) reaches it."""
    results = run_ranks(_both_steps, 4)
    full = sum(p.numel() * 4 for p in _Deep().parameters())
    print(f"full gradient {full} B; sharded step {[s for s, _ in results]}; gathered {[g for _, g in results]}")
    assert max(s for s, _ in results) < full
    assert min(g for _, g in results) >= full


@pytest.mark.control
def test_weights_written_behind_the_version_counter_are_not_served_stale(monkeypatch):
    """FSDP2 writes its gathered parameters under `_unsafe_preserve_version_counter` (often at the
    same address): with the packed-weight cache on, the product after such a write uses the old
    weights (the control); shard_model's `disable_packed_cache` makes it use the new ones."""
    from titan_audit import batch_invariant
    from titan_audit.batch_invariant.cpu import matmul

    monkeypatch.setattr(matmul.PACKED_CACHE, "enabled", True)
    weight = nn.Parameter(_wide((256, 256), 4))  # big enough to be cached (matmul.CACHE_MIN_ELEMS)
    x = _wide((3, 256), 5)

    def product_after_rewrite() -> tuple[torch.Tensor, torch.Tensor]:
        with batch_invariant.enabled():
            torch.mm(x, weight.t())  # seen: packed
            new = _wide((256, 256), 6)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
                weight.copy_(new)
            got = torch.mm(x, weight.t())
            matmul.clear_packed_cache()
            return got, torch.mm(x, new.t())

    stale, fresh = product_after_rewrite()
    assert not torch.equal(stale, fresh)  # control: the cache served the previous weights
    matmul.disable_packed_cache()
    weight.data.copy_(_wide((256, 256), 4))
    got, fresh = product_after_rewrite()
    assert torch.equal(got.view(torch.int32), fresh.view(torch.int32))
