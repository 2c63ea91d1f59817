"""Checkpoint verification by piece (hashes.json format 3, audit/by_piece.py): each tensor's
digest is its audit fingerprint, each piece's lanes are checked by the ranks that read it, also
after resharding (FSDP2 W = 4 saved, W = 2 loaded); format 2 (lattice version 1) and format 1
checkpoints still load and verify. Controls: a flipped byte in one piece's file is reported with
that piece, the rank that wrote it and the rank that read it; a wrong format-1 digest is refused;
format 2's lanes checked as format 3's are refused."""

import json

import pytest
import torch
from distributed import run_ranks
from trainer.test_checkpoint import _flip_a_weight_byte

from titan_audit.audit import fingerprint
from titan_audit.audit.fingerprint import whole_digest, whole_hash_limit
from titan_audit.batch_invariant.cpu import lattice
from titan_audit.trainer.checkpoint import Checkpointer, CorruptCheckpointError

C = 512  # bytes: the weights below are several times C, the biases smaller


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer):
    """One optimizer step on known gradients (a DTensor parameter gets this rank's pieces)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        p.grad = (
            distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full
        )
    optimizer.step()


def test_format_3_holds_the_record_digests_and_the_pieces(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    with whole_hash_limit(C):
        Checkpointer(tmp_path).save(1, model, optimizer, {})
        hashes = json.loads((tmp_path / "checkpoints" / "step_00000001" / "hashes.json").read_text())
        assert hashes["format"] == 3 and hashes["whole_hash_bytes"] == C
        weight, bias = model[0].weight, model[0].bias
        assert hashes["tensors"]["model.0.weight"] == fingerprint(weight)  # the audit record's digest
        assert hashes["tensors"]["model.0.bias"] == fingerprint(bias) == whole_digest(bias)  # at most C: xxh3
        assert hashes["tensors"]["model.0.weight"] != whole_digest(weight)  # above C: the lattice digest
        assert hashes["meta"]["model.0.weight"] == "float32[48, 32]"
        assert hashes["pieces"]["model.0.weight"] == [
            {"index": [[[0, 48]], [[0, 32]]], "lanes": hashes["pieces"]["model.0.weight"][0]["lanes"], "ranks": [0]}
        ]
        assert set(hashes["pieces"]) == set(hashes["tensors"]) == set(hashes["meta"])
        assert "optim.0.weight.exp_avg" in hashes["tensors"] and "optim.0.weight.step" in hashes["tensors"]


def test_flipped_byte_names_the_piece_and_format_1_still_loads(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    ckpt = Checkpointer(tmp_path)
    with whole_hash_limit(C):
        ckpt.save(1, model, optimizer, {})
        ckpt.save(2, model, optimizer, {})
        fresh, fresh_opt = _model_and_optimizer(seed=3)
        ckpt.load(1, fresh, fresh_opt)
        assert torch.equal(fresh[0].weight.view(torch.int32), model[0].weight.view(torch.int32))
        _flip_a_weight_byte(ckpt.path(2), model[2].weight)
        with pytest.raises(CorruptCheckpointError) as error:
            ckpt.load(2, *_model_and_optimizer())
    assert "1 tensor(s) do not match hashes.json, first model.2.weight: piece [0, 8) x [0, 48)" in str(error.value)
    assert "held by rank(s) [0] when saved) differs as read by rank(s) [0]" in str(error.value)

    # format 1: every tensor's whole xxh3, as written before format 2
    path = ckpt.path(1) / "hashes.json"
    hashes = json.loads(path.read_text())
    state = {**{f"model.{k}": v for k, v in model.state_dict().items()}}
    for fqn, values in optimizer.state_dict()["state"].items():
        name = [n for n, _ in model.named_parameters()][fqn]
        state.update({f"optim.{name}.{k}": v for k, v in values.items()})
    legacy = {"format": 1, "step": 1, "tensors": {k: whole_digest(v) for k, v in sorted(state.items())}}
    path.write_text(json.dumps({**legacy, "param_groups": hashes["param_groups"]}))
    fresh, fresh_opt = _model_and_optimizer(seed=4)
    ckpt.load(1, fresh, fresh_opt)
    assert torch.equal(fresh[2].weight.view(torch.int32), model[2].weight.view(torch.int32))
    legacy["tensors"]["model.2.bias"] = "0" * 32  # control: a wrong format-1 digest is refused
    path.write_text(json.dumps({**legacy, "param_groups": hashes["param_groups"]}))
    with pytest.raises(CorruptCheckpointError, match=r"1 tensor\(s\) do not match hashes.json, first model\.2\.bias"):
        ckpt.load(1, *_model_and_optimizer())


def test_pieces_hashed_on_a_device_are_recorded_and_verified_without_reading_each_one():
    """Routed through the device path (tests/device_routing.py, as a GPU rank's pieces are): the
    digests and pieces are those of the CPU kernel and verify, and no tensor's or piece's lanes
    are read alone (the device is read once per exchange). Controls: reading each share at once
    is counted; an element changed after the record is found under the routing."""
    from device_routing import read_at_once, routed_to_device

    from titan_audit.audit.by_piece import digests_by_piece, verify_by_piece

    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    with whole_hash_limit(C):
        expected = digests_by_piece(named)
        with routed_to_device() as reads:
            got = digests_by_piece(named)
            problems = verify_by_piece(named, got, "the record")
            routed_reads = reads[0]
            with read_at_once():
                at_once = digests_by_piece(named)
            changed = [(name, t.clone()) for name, t in named]
            changed[2][1][3, 5] += 1.0  # 2.weight [8, 48]: above C
            found = verify_by_piece(changed, got, "the record")
    assert got == expected == at_once
    assert problems == [] and routed_reads == 0
    assert reads[0] > routed_reads  # control: the reads at once were counted
    assert len(found) == 1 and found[0].startswith("2.weight: piece [0, 8) x [0, 48)")


def test_format_2_checkpoints_verify_with_lattice_version_1(tmp_path):
    """A checkpoint an older titan-audit wrote (format 2: lattice version 1 lanes) still loads and
    verifies; control: the same lanes labelled format 3 are checked as version 2's and refused."""
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    ckpt = Checkpointer(tmp_path)
    path = ckpt.path(1) / "hashes.json"
    with whole_hash_limit(C):
        with lattice.using_version(1):
            ckpt.save(1, model, optimizer, {})
        hashes = json.loads(path.read_text())
        path.write_text(json.dumps({**hashes, "format": 2}))
        fresh, fresh_opt = _model_and_optimizer(seed=5)
        ckpt.load(1, fresh, fresh_opt)
        assert torch.equal(fresh[0].weight.view(torch.int32), model[0].weight.view(torch.int32))
        path.write_text(json.dumps({**hashes, "format": 3}))
        # every piece's lanes (all 16 tensors: 4 parameters, 3 AdamW states each) are version 1's
        with pytest.raises(CorruptCheckpointError, match=r": 16 tensor\(s\) do not match hashes.json"):
            ckpt.load(1, *_model_and_optimizer())


def _fsdp(world_size):
    from torch.distributed.fsdp import fully_shard

    model, _ = _model_and_optimizer()
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_fsdp(rank, world_size, run_dir):
    with whole_hash_limit(C):
        model, optimizer = _fsdp(world_size)
        _step(model, optimizer)
        Checkpointer(run_dir).save(1, model, optimizer, {})
        Checkpointer(run_dir).save(2, model, optimizer, {})
        return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _load_fsdp(rank, world_size, run_dir):
    out = {}
    with whole_hash_limit(C):
        model, optimizer = _fsdp(world_size)
        Checkpointer(run_dir).load(1, model, optimizer)
        out["loaded"] = {n: p.full_tensor() for n, p in model.named_parameters()}
        try:
            Checkpointer(run_dir).load(2, model, optimizer)
        except CorruptCheckpointError as error:
            out["error"] = str(error)
    return out


def test_fsdp2_w4_checkpoint_verifies_at_w2_and_a_flipped_byte_is_found_by_its_reader(tmp_path):
    saved = run_ranks(_save_fsdp, 4, args=(str(tmp_path),))  # two process groups: ~15 s on 2 cores
    hashes = json.loads((tmp_path / "checkpoints" / "step_00000001" / "hashes.json").read_text())
    rows = [p["index"][0] for p in hashes["pieces"]["model.0.weight"]]
    assert rows == [[[0, 12]], [[12, 24]], [[24, 36]], [[36, 48]]]
    assert [p["ranks"] for p in hashes["pieces"]["model.0.weight"]] == [[0], [1], [2], [3]]
    # control: one byte of rank 3's piece of 0.weight (rows 36..47) flipped in step 2's files;
    # at W = 2 rank 1 holds rows 24..47, so rank 1 reads it
    _flip_a_weight_byte(tmp_path / "checkpoints" / "step_00000002", saved[3]["0.weight"])
    loaded = run_ranks(_load_fsdp, 2, args=(str(tmp_path),))
    full = torch.cat([s["0.weight"] for s in saved])
    for rank in (0, 1):
        assert torch.equal(loaded[rank]["loaded"]["0.weight"].view(torch.int32), full.view(torch.int32))
        error = loaded[rank]["error"]  # every rank refuses, with the same line
        assert "first model.0.weight: piece [36, 48) x [0, 32) (held by rank(s) [3] when saved)" in error
        assert "differs as read by rank(s) [1]" in error
