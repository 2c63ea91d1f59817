"""Recorder on gloo ranks: a W=2 run logs the same records as W=1 (rank not in the key); DTensors
are recorded as their full logical tensor."""

import pytest
import torch
import torch.distributed as dist
from audit._audit_runs import Tiny, batch, microbatch_loss
from distributed import run_ranks

from titan_audit.audit import Recorder, compare_runs, fingerprint, read_audit_log
from titan_audit.audit.log import part_files

STEPS, V = 2, 2


def _train_ranks(rank: int, world_size: int, run_dir: str) -> None:
    """V microbatches per step, rank r processes [r*V/W, (r+1)*V/W); gradients summed across ranks."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recorder = Recorder(run_dir, model, level="full", rank=rank, flush_every_steps=1)
    per_rank = V // world_size
    for step in range(STEPS):
        recorder.start_step(step)
        for mb in range(rank * per_rank, (rank + 1) * per_rank):
            recorder.set_microbatch(mb)
            ids = batch(step, mb)
            recorder.record_data(ids)
            loss = microbatch_loss(model, ids, V)
            recorder.record_loss(loss)
            loss.backward()
        recorder.set_microbatch(-1)
        if world_size > 1:
            for p in model.parameters():  # W=2: g0 + g1, the same single addition as W=1
                dist.all_reduce(p.grad)
        recorder.record_grads()
        opt.step()
        recorder.record_optimizer(opt)
        recorder.record_params()
        opt.zero_grad(set_to_none=True)
        recorder.end_step()
    recorder.close()


def _dtensor_record(rank: int, world_size: int, run_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 3
    with Recorder(run_dir, level="params", rank=rank) as recorder:
        recorder.start_step(0)
        recorder.record("param", "w", distribute_tensor(full, mesh, [Shard(0)]))
        recorder.set_microbatch(rank)
        recorder.record("loss", "local", distribute_tensor(full, mesh, [Shard(1)]))


@pytest.mark.slow
def test_world_size_2_compares_identical_to_world_size_1(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with 1 intra-op thread: the thread count decides bits too
    try:
        _train_ranks(0, 1, str(tmp_path / "w1"))
    finally:
        torch.set_num_threads(threads)
    run_ranks(_train_ranks, world_size=2, args=(str(tmp_path / "w2"),))
    ranks = {int(p.name[6:11]) for p in part_files(tmp_path / "w2")}
    assert ranks == {0, 1}, "both ranks wrote parts"
    table = read_audit_log(tmp_path / "w2")
    assert set(table.column("rank").to_pylist()) == {0, 1}
    result = compare_runs(tmp_path / "w1", tmp_path / "w2")
    assert result.identical, result.first_divergence
    assert result.compared == result.records_a == result.records_b


@pytest.mark.slow
def test_dtensor_recorded_as_full_tensor_once(tmp_path):
    run_ranks(_dtensor_record, world_size=2, args=(str(tmp_path),))
    rows = read_audit_log(tmp_path).to_pylist()
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 3
    assert [(r["name"], r["rank"], r["hash"], r["shape"]) for r in rows] == [
        ("w", 0, fingerprint(full), "[6, 4]"),
        ("local", 0, fingerprint(full), "[6, 4]"),
    ]
