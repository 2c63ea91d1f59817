"""The train loop on real gloo processes: G3 (same audit log at W = 1, 2, 4 and across a resume at
another W), G1, a real training signal, and the negative controls that show the checks can fail."""

import json

import pytest
from distributed import run_ranks

from titan_audit.audit import compare_runs, read_audit_log
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.replay import compare_replay, prepare_replay
from titan_audit.trainer.train import train

PHASES = {"data", "loss", "grad", "param", "optim"}


def _train_rank(rank, world_size, config_dict, out, kwargs):
    return train(from_dict(config_dict), out, quiet=True, **kwargs).losses


def _run(out, world_size, recipe="tiny-dense", overrides=(), **kwargs):
    config = load_config(recipe, ["steps=8", *overrides])
    return run_ranks(_train_rank, world_size, args=(to_dict(config), str(out), kwargs))[0]


def _hashes(run, step):
    return json.loads((run / "checkpoints" / f"step_{step:08d}" / "hashes.json").read_text())["tensors"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    losses = {w: _run(root / f"w{w}", w) for w in (1, 2, 4)}
    return root, losses


def test_tiny_dense_is_bitwise_identical_at_world_sizes_1_2_4(dense):
    root, losses = dense
    phases = set(read_audit_log(root / "w1", columns=["phase"])["phase"].to_pylist())
    assert PHASES <= phases, phases
    for w in (2, 4):
        result = compare_runs(root / "w1", root / f"w{w}")
        assert result.identical, result.first_divergence
        assert result.compared == result.records_a == result.records_b > 0
        assert _hashes(root / "w1", 8) == _hashes(root / f"w{w}", 8)
        assert losses[w] == losses[1]  # the logged step loss is tree-reduced: same float at every W
    manifest = json.loads((root / "w4" / "manifest.json").read_text())
    assert manifest["world_size_history"][0]["world_size"] == 4
    assert "fingerprint_version" in manifest["fingerprint"] and manifest["config"]["seed"] == 0
    assert manifest["digest"] == {"lattice": 2, "whole_hash_bytes": 2 << 20}


def test_loss_goes_down_on_the_synthetic_corpus(dense):
    _, losses = dense
    import math

    first, last = losses[1][0], losses[1][-1]
    assert last < 0.5 * first, losses[1]
    assert last < math.log(258), losses[1]  # below the uniform loss over the byte vocabulary


def test_negative_control_plain_all_reduce_differs(dense, tmp_path):
    root, _ = dense
    _run(tmp_path / "plain", 2, overrides=["determinism.enabled=false", "checkpoint.interval=0"], stop_at=2)
    result = compare_runs(root / "w1", tmp_path / "plain")
    assert not result.identical
    first = result.first_divergence
    assert (first["step"], first["phase"], first["kind"]) == (1, "grad", "hash"), first


def test_negative_control_another_seed_differs(dense, tmp_path):
    root, _ = dense
    _run(tmp_path / "seed1", 1, overrides=["seed=1", "checkpoint.interval=0"], stop_at=1)
    first = compare_runs(root / "w1", tmp_path / "seed1").first_divergence
    assert (first["step"], first["phase"], first["kind"]) == (1, "data", "hash"), first


def test_w4_checkpoint_resumed_at_w2_matches_the_w4_run(dense, tmp_path):
    root, _ = dense
    replay = prepare_replay(root / "w4", 4, tmp_path / "w4to2")
    losses = run_ranks(
        _train_rank,
        2,
        args=(json.loads((replay / "manifest.json").read_text())["config"], str(replay), {"resume": True}),
    )[0]
    assert losses == dense[1][4][4:]
    assert compare_replay(root / "w4", replay, 4, 8).identical
    assert _hashes(replay, 8) == _hashes(root / "w4", 8)
    # negative control: the same comparison sees a run that took another path (plain all_reduce)
    plain = tmp_path / "plain"
    _run(plain, 2, overrides=["determinism.enabled=false"], stop_at=5)
    assert not compare_replay(root / "w4", plain, 4, 5).identical


def test_tiny_moe_is_bitwise_identical_at_world_sizes_1_and_2(tmp_path):
    for w in (1, 2):
        _run(tmp_path / f"w{w}", w, recipe="tiny-moe", overrides=["steps=4", "checkpoint.interval=0"])
    result = compare_runs(tmp_path / "w1", tmp_path / "w2")
    assert result.identical, result.first_divergence
    assert any(
        n.endswith("experts.w1") or "experts" in n
        for n in read_audit_log(tmp_path / "w1", columns=["name"])["name"].to_pylist()
    )
    # negative control: a plain all_reduce at W=2 is caught on the MoE model too
    _run(
        tmp_path / "plain",
        2,
        recipe="tiny-moe",
        overrides=["steps=4", "checkpoint.interval=0", "determinism.enabled=false"],
        stop_at=1,
    )
    assert not compare_runs(tmp_path / "w1", tmp_path / "plain").identical


def _train_jobs(rank, world_size, jobs):
    """Several runs one after the other in the same ranks (process start-up dominates their cost)."""
    return [train(from_dict(config), out, quiet=True, **kwargs).losses for config, out, kwargs in jobs]


def test_fsdp2_matches_dp_bitwise_and_resumes_at_another_world_size_and_mode(dense, tmp_path):
    root, losses = dense
    fsdp, native = tmp_path / "fsdp-w2", tmp_path / "fsdp-native"
    fsdp_config = to_dict(load_config("tiny-dense", ["steps=8", "parallel.mode=fsdp"]))
    native_config = to_dict(
        load_config(
            "tiny-dense", ["steps=8", "parallel.mode=fsdp", "determinism.enabled=false", "checkpoint.interval=0"]
        )
    )
    # the runs at W=2 in the same two ranks, one after the other: DP's step-4 checkpoint resumed
    # under FSDP2 (first, in fresh processes), FSDP2 from step 0, and the negative control (last)
    to_fsdp = prepare_replay(root / "w1", 4, tmp_path / "to-fsdp")
    jobs = [
        (fsdp_config, str(to_fsdp), {"resume": True, "stop_at": 6}),
        (fsdp_config, str(fsdp), {}),
        (native_config, str(native), {"stop_at": 1}),
    ]
    fsdp_losses = run_ranks(_train_jobs, 2, args=(jobs,))[0][1]
    assert fsdp_losses == losses[1]
    result = compare_runs(root / "w1", fsdp)  # FSDP2 at W=2 == replicated DP at W=1, record for record
    assert result.identical and result.compared == result.records_a, result.first_divergence
    assert _hashes(fsdp, 8) == _hashes(root / "w1", 8)  # checkpoint tensors too (DTensors hash as full)
    replay = prepare_replay(fsdp, 4, tmp_path / "fsdp-w2to4")
    run_ranks(
        _train_rank,
        4,
        args=(
            json.loads((replay / "manifest.json").read_text())["config"],
            str(replay),
            {"resume": True, "stop_at": 6},
        ),
    )
    assert compare_replay(root / "w1", replay, 4, 6).identical
    # the checkpoints are reshardable across parallel modes too: FSDP2 -> DP at W=1, DP -> FSDP2 at W=2
    to_dp = prepare_replay(fsdp, 4, tmp_path / "to-dp")
    config = to_dict(load_config("tiny-dense", ["steps=8", "parallel.mode=dp"]))
    run_ranks(_train_rank, 1, args=(config, str(to_dp), {"resume": True, "stop_at": 6}))
    for switched, mode, world_size in ((to_dp, "dp", 1), (to_fsdp, "fsdp", 2)):
        manifest = json.loads((switched / "manifest.json").read_text())
        assert manifest["config"]["parallel"]["mode"] == mode
        assert manifest["world_size_history"][-1] | {"time": 0} == {
            "world_size": world_size,
            "start_step": 4,
            "parallel_mode": mode,
            "mesh": {"device_type": "cpu", "dp": world_size, "tp": 1},
            "time": 0,
        }
        assert compare_replay(root / "w1", switched, 4, 6).identical, mode
    # negative control: FSDP2's own reduce-scatter (determinism off) gives other gradient bits
    first = compare_runs(root / "w1", native).first_divergence
    assert (first["step"], first["phase"], first["kind"]) == (1, "grad", "hash"), first
