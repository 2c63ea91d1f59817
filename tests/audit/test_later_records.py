"""A GPU tensor's record is queued on its device and read back with the step's others
(summary.summarize_later / read_back, Recorder._read_later): the rows are those of reading
each record at once, bit for bit, and what is done to a tensor after its record does not reach
the row. Here CPU tensors are routed to the device path (as a GPU tensor is); on CUDA
(scripts/gpu_check.sh, marker `gpu`) a full step records without one synchronisation.

Negative controls: another input gives other rows; the in-place change made after the record
is one the row would show if it were read late (a record taken after it differs)."""

import json
import math

import pytest
import torch
from torch import nn

from titan_audit.audit import Recorder, recorder, shards, summary
from titan_audit.audit.fingerprint import whole_hash_limit

C = 1024  # bytes: the test's activations lie on both sides of it


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).to(device)


def _step(rec: Recorder, model: nn.Module, x: torch.Tensor) -> None:
    rec.start_step(0)
    rec.set_microbatch(0)
    rec.record_data(x)
    loss = model(x).square().mean()
    rec.record_loss(loss)
    loss.backward()
    rec.set_microbatch(-1)
    rec.record_grads()


def _both(tmp_path, x: torch.Tensor) -> tuple[list, list, int]:
    """One step of one model under two full-level Recorders (so both read the same tensors):
    one queues its device records, the other reads each at once. Their rows, and how many of the
    queuing one's were still unread (None) just before end_step."""
    model = _model()
    queued = Recorder(tmp_path / "queued", model, level="full")
    direct = Recorder(tmp_path / "direct", model, level="full")
    direct._summary_of = _at_once  # what summarize() reads for a GPU tensor, at once
    for rec in (queued, direct):
        rec.start_step(0)
        rec.set_microbatch(0)
        rec.record_data(x)
    loss = model(x).square().mean()
    for rec in (queued, direct):
        rec.record_loss(loss)
    loss.backward()
    for rec in (queued, direct):
        rec.set_microbatch(-1)
        rec.record_grads()
    unread = sum(row is None for row in queued._rows)
    out = []
    for rec in (queued, direct):
        rec.end_step()
        out.append(list(rec._rows))
        rec.close()
    return *out, unread


def _at_once(tensor: torch.Tensor, with_stats: bool) -> summary.Summary:
    if tensor.nbytes > C:
        return summary._summarize_on_device(tensor, with_stats)
    return summary.summarize(tensor.clone(), with_stats=with_stats)  # a host copy


@pytest.fixture
def routed(monkeypatch):
    """Every tensor goes through the device path (and none to the CPU batches, as a GPU tensor),
    with C = 1024 bytes."""
    monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
    monkeypatch.setattr(recorder, "batch_meta", lambda tensor: None)
    monkeypatch.setattr(recorder, "batch_metas", lambda tensors: None)
    with whole_hash_limit(C):
        yield


def test_queued_rows_are_the_rows_read_at_once_bit_for_bit(tmp_path, routed):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    queued, direct, unread = _both(tmp_path / "x", x)
    assert unread == len(queued)  # nothing was read before end_step
    nbytes = {4 * math.prod(json.loads(row[5])) for row in queued}  # float32 records
    assert min(nbytes) <= C < max(nbytes)
    assert all(row is not None for row in queued)
    # every field, the hash and both statistics as float64 bits
    assert [r[:7] + (_bits(r[7]), _bits(r[8])) + r[9:] for r in queued] == [
        r[:7] + (_bits(r[7]), _bits(r[8])) + r[9:] for r in direct
    ]
    other, _, _ = _both(tmp_path / "other", x + 1)
    assert [r[6] for r in other] != [r[6] for r in queued]  # control: another input, other hashes


def _bits(value: float | None) -> int | None:
    return None if value is None else torch.tensor(value, dtype=torch.float64).view(torch.int64).item()


@pytest.mark.parametrize("size", [64, 4096], ids=["at most C", "above C"])
def test_a_change_after_the_record_does_not_reach_the_row(tmp_path, routed, size):
    t = torch.randn(size // 4, generator=torch.Generator().manual_seed(2))
    original = t.clone()
    rec = Recorder(tmp_path, None, level="params")
    rec.start_step(0)
    rec.record("data", "t", t)
    t.mul_(2)  # queued after the record, as on the device's stream
    rec.record("data", "t_after", t)
    rec.end_step()
    (before, after) = rec._rows
    rec.close()
    assert before[6] == summary.summarize(original).hash
    assert after[6] == summary.summarize(t).hash != before[6]  # control: read late, it would differ


def test_queued_records_are_read_once_per_step_or_when_they_hold_too_much(tmp_path, monkeypatch, routed):
    reads = []
    real = recorder.read_back

    def counted(items):
        reads.append(len(items))
        return real(items)

    monkeypatch.setattr(recorder, "read_back", counted)
    rec = Recorder(tmp_path / "a", _model(), level="full")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    _step(rec, rec.module, x)
    rec.end_step()
    assert len(reads) == 1 and reads[0] == len(rec._rows)
    rows = list(rec._rows)
    rec.close()
    reads.clear()
    monkeypatch.setattr(recorder, "LATER_BYTES", 1200)  # two device values and a small copy
    rec = Recorder(tmp_path / "b", _model(), level="full")
    _step(rec, rec.module, x)
    assert len(reads) > 1 and min(reads) > 1  # read inside the step once they hold more than LATER_BYTES
    rec.end_step()
    assert sum(reads) == len(rows) and rec._rows == rows
    rec.close()


@pytest.mark.gpu
def test_on_cuda_a_full_step_records_without_synchronising(tmp_path, monkeypatch):
    """The second step of a full-level Recorder on a CUDA model (its first one made the lattice
    block keys) runs its forward, backward and record calls with torch's sync debug mode set to
    error; its rows equal those of the same two steps read record by record. Control: the debug
    mode does raise on a read of a device value."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)).cuda()

    def two_steps(name: str, watch: bool) -> list:
        model = _model("cuda")
        rec = Recorder(tmp_path / name, model, level="full")
        for step in range(2):
            if watch and step == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                _step(rec, model, x)
                if watch and step == 1:
                    with pytest.raises(RuntimeError, match="synchroniz"):
                        x.sum().item()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            rec.end_step()
            model.zero_grad(set_to_none=True)
        rows = list(rec._rows)
        rec.close()
        return rows

    with whole_hash_limit(C):
        queued = two_steps("queued", watch=True)
        monkeypatch.setattr(recorder, "summarized_later", lambda tensor: False)
        direct = two_steps("direct", watch=False)
    assert len(queued) == len(direct) > 0
    assert [r[:7] for r in queued] == [r[:7] for r in direct]


@pytest.mark.gpu
def test_on_cuda_fsdp2_records_read_the_device_once_per_exchange(tmp_path, monkeypatch):
    """A params-level Recorder over an FSDP2 model on one GPU (a mesh of one rank, NCCL): its
    second step's record calls run with torch's sync debug mode set to error except inside
    exchange.read, the one read of each exchange's gathered rows or pieces (at most two a call:
    the lanes of the tensors above C, the pieces of those of at most C); every grad and param
    record's digest is the fingerprint of the full tensor. Control: with each share's lanes read
    at once, the grads' summaries raise under the same watch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_audit.audit import exchange, fingerprint
    from titan_audit.batch_invariant.cpu import lattice

    reads = []
    real_read = exchange.read

    def allowed_read(gathered):
        torch.cuda.set_sync_debug_mode("default")
        try:
            if reads:  # inside a watched call
                reads[-1] += 1
            return real_read(gathered)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def watched(call, *args) -> None:
        torch.cuda.synchronize()
        reads.append(0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _model("cuda")
        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).cuda()
        monkeypatch.setattr(exchange, "read", allowed_read)
        with whole_hash_limit(C):
            rec = Recorder(tmp_path / "run", model, level="params")
            for step in range(2):
                rec.start_step(step)
                model(x).square().mean().backward()
                record = watched if step == 1 else (lambda call, *args: call(*args))
                record(rec.record_grads)
                opt.step()
                record(rec.record_optimizer, opt)
                record(rec.record_params)
                rec.end_step()
                if step == 0:
                    opt.zero_grad(set_to_none=True)
            rows = {(r[1], r[3]): r[6] for r in rec._rows if r[0] == 1}
            for name, p in model.named_parameters():
                assert rows[("grad", name)] == fingerprint(p.grad.full_tensor().cpu()), name
                assert rows[("param", name)] == fingerprint(p.full_tensor().cpu()), name
            rec.close()
            assert len(reads) == 3 and all(1 <= n <= 2 for n in reads), reads

            def read_at_once(local, where):
                return torch.tensor([lattice.to_signed(v) for v in shards.share_lanes(local, where)]).cuda()

            monkeypatch.setattr(exchange, "share_sums", read_at_once)
            grads = [(p.grad, True, 0) for p in model.parameters()]  # what record_grads summarises
            with pytest.raises(RuntimeError, match="synchroniz"):
                watched(summary.summarize_sharded, grads)
    finally:
        dist.destroy_process_group()
