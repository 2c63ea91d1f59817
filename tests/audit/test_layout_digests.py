"""Record digests computed where the data lives are the same at every layout (audit/shards.py):

- on 4 gloo ranks, DTensors of known tensors under 1-d and 2-d layouts (Shard(0) in uneven
  torch.chunk pieces, one of them empty; Shard(1); Replicate; two mesh dims on one tensor dim;
  FSDP2's _StridedShard over a TP shard; a Partial) fingerprint and summarise as the unsharded
  tensor on every rank, above C (the lattice digest) and at most C (gathered, xxh3), with exact
  absmax; a Recorder under real FSDP2 (`fully_shard`) and under a (dp, tp) = (2, 2) mesh with
  TP-sharded weights writes the records of the unsharded run, calling no `full_tensor()`;
- under DDP (`split_replicated`), 4 replicas each hash their share of the dim-0 rows of every
  step-level tensor above C and write the records of the unsharded run, at 1/W of the bytes;
- controls: a one-element change on one rank's shard, and two elements swapped between the
  pieces of two ranks, give other digests; a DDP replica perturbed in its own share changes the
  record;
- routed through the device path (as a GPU rank's pieces are: tests/device_routing.py), the same
  summaries and FSDP2 records come from lanes and statistics left where they were computed, with
  no per-tensor read (no call of the functions that read one record's lanes or statistics);
  control: reading each share's lanes and statistics at once gives the same summaries and makes
  those reads;
- (slow) the trainer's audit logs at W = 1, 2, 4 in DP and FSDP2 and at (dp, tp) = (1, 2) and
  (2, 2), with C = 16 KiB so that tiny-dense's tensors (up to 128 C) take the lattice path
  sharded, are identical record for record.
"""

import struct

import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import Recorder, compare_runs, read_audit_log
from titan_audit.audit.fingerprint import fingerprint, whole_hash_limit
from titan_audit.audit.summary import stats, summarize

C = 1024  # bytes: most tensors here are many times C


def _full(name):
    g = torch.Generator().manual_seed(["a", "b", "e", "small", "ints"].index(name))
    shapes = {"a": (37, 29), "b": (6, 50), "e": (3, 120), "small": (4, 4), "ints": (10, 40)}
    if name == "ints":
        return torch.randint(-1000, 1000, shapes[name], generator=g)
    t = torch.randn(shapes[name], generator=g)
    return t.bfloat16() if name == "b" else t


def _layouts():
    """(name, tensor, mesh shape, placements) of every layout checked."""
    from torch.distributed.tensor import Replicate, Shard

    return [
        ("a", (4,), [Shard(0)]),  # 10, 10, 10, 7 rows
        ("a", (4,), [Shard(1)]),
        ("a", (4,), [Replicate()]),
        ("b", (4,), [Shard(1)]),
        ("e", (4,), [Shard(0)]),  # 1, 1, 1, 0 rows: rank 3 holds nothing
        ("a", (2, 2), [Shard(0), Shard(1)]),
        ("a", (2, 2), [Shard(1), Shard(0)]),
        ("a", (2, 2), [Shard(0), Shard(0)]),
        ("a", (2, 2), [Replicate(), Shard(1)]),
        ("small", (2, 2), [Shard(0), Shard(1)]),
        ("small", (4,), [Shard(0)]),
    ]


def _model(tp_mesh=None):
    """Two linears of known weights; with `tp_mesh`, the first TP-sharded on dim 0, the second on 1."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 24, bias=False), torch.nn.Linear(24, 20))
    if tp_mesh is not None:
        for layer, dim in ((model[0], 0), (model[1], 1)):
            sharded = distribute_tensor(layer.weight.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
            layer.weight = torch.nn.Parameter(sharded)
    return model


def _record_step(model, run_dir, rank, *, split_replicated=False, perturb=None):
    """Known gradients (as the trainer's sharded ones: this rank's pieces), one AdamW step, the
    step's grad/optim/param records. Every step-level record is written by rank 0. `perturb`:
    (parameter name, index) of this rank's gradient element to change. Returns the counters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recorder = Recorder(run_dir, model, level="params", rank=rank, stats=True, split_replicated=split_replicated)
    recorder.start_step(1)
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(len(name))
        full = torch.randn(p.shape, generator=g)
        p.grad = (
            distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full
        )
        if perturb is not None and perturb[0] == name:
            p.grad[perturb[1]] += 1.0
    recorder.record_grads()
    opt.step()
    recorder.record_optimizer(opt)
    recorder.record_params()
    recorder.end_step()
    recorder.close()
    return recorder.counters


def _forbid_full_tensor():
    from torch.distributed.tensor import DTensor

    def refuse(self, *args, **kwargs):
        raise AssertionError("a record called full_tensor()")

    DTensor.full_tensor = refuse


def _rank(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    out = {"fingerprints": [], "summaries": []}
    with whole_hash_limit(C):
        meshes = {
            (4,): init_device_mesh("cpu", (4,)),
            (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        }
        saved_full_tensor = DTensor.full_tensor
        _forbid_full_tensor()
        for name, mesh_shape, placements in _layouts():
            dt = distribute_tensor(_full(name), meshes[mesh_shape], placements, src_data_rank=None)
            out["fingerprints"].append(fingerprint(dt))
            out["summaries"].append(tuple(summarize(dt, with_stats=True)))
        # a Partial: rank 0 holds the integers, the others zeros; the sum is the tensor
        local = _full("ints") if rank == 0 else torch.zeros_like(_full("ints"))
        out["partial"] = fingerprint(DTensor.from_local(local, meshes[(4,)], [Partial()], run_check=False))
        # controls: one element changed on rank 1's shard; rows 0 and 10 (ranks 0 and 1) swapped
        from torch.distributed.tensor import Shard

        changed = distribute_tensor(_full("a"), meshes[(4,)], [Shard(0)], src_data_rank=None)
        if rank == 1:
            changed.to_local()[2, 3] += 1.0
        out["changed"] = fingerprint(changed)
        swapped = _full("a").clone()
        swapped[[0, 10]] = swapped[[10, 0]]
        out["swapped"] = fingerprint(distribute_tensor(swapped, meshes[(4,)], [Shard(0)], src_data_rank=None))
        # records under real FSDP2 over the 4 ranks, and under FSDP2 x TP on the (2, 2) mesh
        fsdp = _model()
        fully_shard(fsdp)
        _record_step(fsdp, f"{root}/fsdp4", rank)
        fsdp_tp = _model(meshes[(2, 2)]["tp"])
        fully_shard(fsdp_tp, mesh=meshes[(2, 2)]["dp"])
        out["placements"] = [str(p.placements) for p in fsdp_tp.parameters()]
        _record_step(fsdp_tp, f"{root}/fsdp-tp22", rank)
        # DDP: every rank holds the plain model; with split_replicated each hashes its share above C
        out["ddp_hashed"] = _record_step(_model(), f"{root}/ddp4", rank, split_replicated=True).hashed_bytes
        # control: rank 2's replica of one gradient differs in a row of its own share (rows 12-17)
        _record_step(
            _model(),
            f"{root}/ddp4-desync",
            rank,
            split_replicated=True,
            perturb=("0.weight", (13, 5)) if rank == 2 else None,
        )
        out["routed"] = _routed(rank, root)
        DTensor.full_tensor = saved_full_tensor
    return out


def _routed(rank, root):
    """The layouts' summaries and an FSDP2 step's records with every piece hashed as a GPU
    rank's (tests/device_routing.py), left where computed until the exchange (exchange.combine);
    and, as the control, the same summaries with each share read at once. Returns both, and
    the per-tensor reads each made."""
    from device_routing import read_at_once, routed_to_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    out = {}
    with routed_to_device() as reads:
        meshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2))}
        tensors = [
            distribute_tensor(_full(name), meshes[shape], placements, src_data_rank=None)
            for name, shape, placements in _layouts()
        ]
        out["summaries"] = [tuple(summarize(dt, with_stats=True)) for dt in tensors]
        fsdp = _model()
        fully_shard(fsdp)
        _record_step(fsdp, f"{root}/fsdp4-routed", rank)
        out["reads"] = reads[0]
        with read_at_once():
            out["at_once"] = [tuple(summarize(dt, with_stats=True)) for dt in tensors]
        out["at_once_reads"] = reads[0] - out["reads"]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):  # one 4-rank process group for the module: ~9 s on 2 cores
    root = tmp_path_factory.mktemp("layouts")
    with whole_hash_limit(C):
        w1_hashed = _record_step(_model(), str(root / "w1"), 0).hashed_bytes
    return root, run_ranks(_rank, 4, args=(str(root),)), w1_hashed


def test_every_layout_fingerprints_and_summarises_as_the_unsharded_tensor(ranks):
    _, results, _ = ranks
    with whole_hash_limit(C):
        for k, (name, mesh_shape, placements) in enumerate(_layouts()):
            full = _full(name)
            expected = fingerprint(full)
            absmax, _ = stats(full.float() if full.dtype is torch.bfloat16 else full)
            for rank, result in enumerate(results):
                assert result["fingerprints"][k] == expected, (rank, name, mesh_shape, placements)
                summary = result["summaries"][k]
                assert summary[:3] == (str(full.dtype).removeprefix("torch."), str(list(full.shape)), expected)
                assert summary[3] == absmax  # exact from per-rank partials; mean is informational
        partial = fingerprint(_full("ints"))
    assert all(r["partial"] == partial for r in results)


def test_control_a_changed_element_and_swapped_rows_give_other_digests(ranks):
    _, results, _ = ranks
    with whole_hash_limit(C):
        expected = fingerprint(_full("a"))
    for result in results:
        assert result["changed"] != expected
        assert result["swapped"] != expected
        assert result["changed"] != result["swapped"]


def test_fsdp2_and_fsdp2_x_tp_records_are_the_unsharded_runs_without_full_tensor(ranks):
    root, results, _ = ranks
    assert "_StridedShard" in results[0]["placements"][0]  # FSDP2 over a dim-0 TP shard
    for run in ("fsdp4", "fsdp-tp22"):
        result = compare_runs(root / "w1", root / run)
        assert result.identical, (run, result.first_divergence)
        # 3 parameters x (grad, param, and the optimizer's step, exp_avg, exp_avg_sq)
        assert result.compared == result.records_a == result.records_b == 3 * 5
    rows = read_audit_log(root / "fsdp4").to_pylist()
    assert {r["rank"] for r in rows} == {0}
    big = [r for r in rows if r["name"] == "0.weight" and r["phase"] == "grad"]
    assert big and big[0]["shape"] == "[24, 32]"


def test_device_pieces_are_summarised_without_reading_each_tensor(ranks):
    """Pieces hashed on their device (routed here): every summary is the read-at-once one, bit
    for bit (mean included), its digest and absmax those of the unsharded CPU summary, and an
    FSDP2 step writes the unsharded run's records, all without reading one tensor's lanes or
    statistics. Control: reading at once is counted (the count can fail)."""
    root, results, _ = ranks
    with whole_hash_limit(C):
        cpu = [summarize(_full(name), with_stats=True) for name, _, _ in _layouts()]
    for rank, result in enumerate(results):
        routed = result["routed"]
        assert routed["reads"] == 0, rank
        assert routed["at_once_reads"] > 0, rank
        for k, (got, at_once) in enumerate(zip(routed["summaries"], routed["at_once"])):
            assert _bits(got) == _bits(at_once), (rank, _layouts()[k])
            assert got[:4] == tuple(cpu[k])[:4], (rank, _layouts()[k])
    result = compare_runs(root / "w1", root / "fsdp4-routed")
    assert result.identical, result.first_divergence
    assert result.compared == 3 * 5


def _bits(summary):
    """A summary with its floats as their IEEE bits (NaN included)."""
    return tuple(struct.pack("<d", v) if isinstance(v, float) else v for v in summary)


TRAIN_C = 16 << 10  # tiny-dense's embedding [2048, 256] fp32 is 128 C; its norms (1 KiB) stay whole
TRAIN_BASE = ["steps=2", "checkpoint.interval=2", "determinism.batch_invariant=true", "data.global_batch_size=4"]
TRAIN_RUNS = {  # name: (overrides, world size)
    "dp-1": ([], 1),
    "dp-2": ([], 2),
    "fsdp-2": (["parallel.mode=fsdp"], 2),
    "tp-12": (["parallel.tp=2"], 2),
    "dp-4": ([], 4),
    "fsdp-4": (["parallel.mode=fsdp"], 4),
    "tp-22": (["parallel.tp=2"], 4),
}


def _train_rank(rank, world_size, jobs):
    from titan_audit.trainer.config import from_dict
    from titan_audit.trainer.train import train

    with whole_hash_limit(TRAIN_C):
        for config, run_dir in jobs:
            train(from_dict(config), run_dir, quiet=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from titan_audit.trainer.config import load_config, to_dict

    root = tmp_path_factory.mktemp("train-layouts")
    for world in (1, 2, 4):
        jobs = [
            (to_dict(load_config("tiny-dense", [*TRAIN_BASE, *overrides])), str(root / name))
            for name, (overrides, size) in TRAIN_RUNS.items()
            if size == world
        ]
        run_ranks(_train_rank, world, args=(jobs,))
    return root


@pytest.mark.slow  # 7 trainer runs in 3 process groups: ~40 s on 2 cores
@pytest.mark.parametrize("run", [name for name in TRAIN_RUNS if name != "dp-1"])
def test_trainer_records_above_c_are_the_same_at_every_layout(trained, run):
    result = compare_runs(trained / "dp-1", trained / run)
    assert result.identical, (run, result.first_divergence)
    assert result.compared == result.records_a == result.records_b > 0
    rows = read_audit_log(trained / run).to_pylist()
    embed = [r for r in rows if r["phase"] == "param" and r["name"] == "embed_tokens.weight"]
    assert embed and embed[0]["shape"] == "[2048, 256]"  # 128 C: hashed by pieces


def test_ddp_replicas_split_the_hashing_and_write_the_unsharded_records(ranks):
    """Under DDP (plain tensors on every rank, split_replicated) the records are the unsharded
    run's and each rank hashes about a quarter of W = 1's bytes above C (the tensors of at most C
    stay whole on the writer). Control: one element of rank 2's replica of a gradient, in its
    own share, changed: that record differs."""
    root, results, w1_hashed = ranks
    result = compare_runs(root / "w1", root / "ddp4")
    assert result.identical, result.first_divergence
    assert result.compared == result.records_a == result.records_b == 3 * 5
    # above C: 0.weight [24, 32] and 1.weight [20, 24] fp32 in grad, exp_avg, exp_avg_sq, param
    large = 4 * (24 * 32 + 20 * 24) * 4
    assert [r["ddp_hashed"] for r in results[1:]] == [large // 4] * 3  # 6 of 24 and 5 of 20 rows each
    assert results[0]["ddp_hashed"] == w1_hashed - large + large // 4  # the writer: its share + the small ones
    desync = compare_runs(root / "w1", root / "ddp4-desync")
    assert not desync.identical
    first = desync.first_divergence
    assert (first["phase"], first["name"]) == ("grad", "0.weight")
