"""A DTensor hashes as its full logical tensor: sharding over 2 gloo ranks does not change it."""

import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import fingerprint


def _full_tensor():
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7


def _hash_sharded(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full_tensor()
    out = {}
    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1)), ("replicate", Replicate())):
        out[name] = fingerprint(distribute_tensor(full, mesh, [placement]))
    local = distribute_tensor(full, mesh, [Shard(0)]).to_local()
    out["local_shard"] = fingerprint(local)  # negative control: a shard alone is not the tensor
    return out


@pytest.mark.slow
def test_dtensor_hash_equals_unsharded_hash_on_every_rank():
    results = run_ranks(_hash_sharded, world_size=2)
    expected = fingerprint(_full_tensor())
    for rank, result in enumerate(results):
        for name in ("shard0", "shard1", "replicate"):
            assert result[name] == expected, f"rank {rank} {name}"
        assert result["local_shard"] != expected
