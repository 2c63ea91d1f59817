"""bf16 compute with fp32 master weights, and the MoE load-balancing loss, in the train loop.

tiny-moe (recipe: router_aux_loss_coef = 0.01) with `model.compute_dtype = "bfloat16"` on real gloo
processes: G3 (W = 1, 2, 4 and FSDP2 give the same audit log, checkpoints, losses and aux-loss
metric), G1 (a second run, the same bits), a resume at another W, fp32 parameters/gradients/
optimizer state, and a falling loss. Negative controls: float32 compute gives other bits from the
first loss on; coefficient 0 gives the same logged losses but other gradients (the aux loss is in
the objective). A resume refuses a changed compute dtype or coefficient.
"""

import json

import pyarrow.parquet as pq
import pytest
from distributed import run_ranks

from titan_audit.audit import compare_runs, read_audit_log
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.launch import LaunchOptions
from titan_audit.trainer.replay import compare_replay, prepare_replay
from titan_audit.trainer.train import TRAIN_JOB, train

pytestmark = pytest.mark.slow  # the module's runs take ~17 s on 2 cores (shared by every test here)

BF16 = ["model.compute_dtype=bfloat16", "steps=2", "checkpoint.interval=1"]


def _train_jobs(rank, world_size, jobs):
    """Several runs one after the other in the same ranks (process start-up dominates their cost)."""
    return [train(from_dict(config), out, quiet=True, **kwargs).losses for config, out, kwargs in jobs]


def _job(out, overrides=(), **kwargs):
    return to_dict(load_config("tiny-moe", [*BF16, *overrides])), str(out), kwargs


def _hashes(run, step):
    return json.loads((run / "checkpoints" / f"step_{step:08d}" / "hashes.json").read_text())["tensors"]


def _metrics(run):
    return pq.read_table(run / "metrics.parquet").to_pylist()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """bf16 runs at W = 4, 2, 1 (with, on the same ranks: a resume of the W=4 run at W=2, FSDP2,
    a second W=1 run, and the two negative controls stopped after step 1). Returns (root, losses)."""
    root = tmp_path_factory.mktemp("bf16-moe")
    losses = {"w4": run_ranks(_train_jobs, 4, args=([_job(root / "w4")],))[0][0]}
    prepare_replay(root / "w4", 1, root / "w4to2")
    replay_config = json.loads((root / "w4to2" / "manifest.json").read_text())["config"]
    jobs = {
        "w2": _job(root / "w2"),
        "w4to2": (replay_config, str(root / "w4to2"), {"resume": True}),
        "fsdp": _job(root / "fsdp", ["parallel.mode=fsdp", "checkpoint.interval=0"]),
    }
    losses.update(zip(jobs, run_ranks(_train_jobs, 2, args=(list(jobs.values()),))[0]))
    jobs = {
        "w1": _job(root / "w1"),
        "again": _job(root / "again"),
        "fp32": _job(root / "fp32", ["model.compute_dtype=float32", "checkpoint.interval=0"], stop_at=1),
        "coef0": _job(root / "coef0", ["model.router_aux_loss_coef=0", "checkpoint.interval=0"], stop_at=1),
    }
    losses.update(zip(jobs, run_ranks(_train_jobs, 1, args=(list(jobs.values()),))[0]))
    return root, losses


def _assert_identical(a, b):
    result = compare_runs(a, b)
    assert result.identical, result.first_divergence
    assert result.compared == result.records_a == result.records_b > 0


def test_bf16_moe_is_bitwise_identical_at_world_sizes_1_2_4(runs):
    root, losses = runs
    log = read_audit_log(root / "w1", columns=["phase", "name", "dtype"]).to_pylist()
    assert sum(r["phase"] == "loss" and r["name"] == "aux_loss" for r in log) == 2 * 8  # per microbatch
    for w in ("w2", "w4"):
        _assert_identical(root / "w1", root / w)
        assert _hashes(root / "w1", 2) == _hashes(root / w, 2)
        assert losses[w] == losses["w1"]
        assert [(m["loss"], m["aux_loss"]) for m in _metrics(root / w)] == [
            (m["loss"], m["aux_loss"]) for m in _metrics(root / "w1")
        ]
    # fp32 masters: parameters, the reduced gradients and AdamW state are float32; the loss too
    dtypes = {
        r["phase"]: r["dtype"] for r in log if r["phase"] in ("param", "grad", "loss") or r["name"].endswith("exp_avg")
    }
    assert dtypes == {"param": "float32", "grad": "float32", "loss": "float32", "optim": "float32"}, dtypes
    assert losses["w1"][1] < losses["w1"][0]  # it trains
    assert all(0.5 < m["aux_loss"] < 8 for m in _metrics(root / "w1"))  # top-2 of 8: 2 when balanced


def test_bf16_run_twice_gives_the_same_bits(runs):
    root, losses = runs
    assert losses["again"] == losses["w1"]
    _assert_identical(root / "w1", root / "again")


def test_bf16_w4_checkpoint_resumed_at_w2_matches(runs):
    root, losses = runs
    assert losses["w4to2"] == losses["w4"][1:]
    assert compare_replay(root / "w4", root / "w4to2", 1, 2).identical
    assert _hashes(root / "w4to2", 2) == _hashes(root / "w4", 2)
    assert not compare_replay(root / "w4", root / "fp32", 0, 1).identical  # the check can fail


def test_bf16_fsdp2_matches_dp(runs):
    """FSDP2's mixed-precision all-gather of bf16 parameters gives the bits of DP."""
    root, losses = runs
    assert losses["fsdp"] == losses["w1"]
    _assert_identical(root / "w1", root / "fsdp")


def test_negative_control_float32_compute_differs_from_the_first_loss(runs):
    root, _ = runs
    first = compare_runs(root / "w1", root / "fp32").first_divergence
    assert (first["step"], first["phase"], first["kind"]) == (1, "loss", "hash"), first


def test_negative_control_aux_coefficient_zero_changes_the_gradient_not_the_losses(runs):
    root, losses = runs
    assert losses["coef0"] == losses["w1"][:1]
    first = compare_runs(root / "w1", root / "coef0").first_divergence
    assert (first["step"], first["phase"], first["kind"]) == (1, "grad", "hash"), first


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.compute_dtype=float32", "model.compute_dtype: 'bfloat16' -> 'float32'"),
        ("model.router_aux_loss_coef=0.02", "model.router_aux_loss_coef: 0.01 -> 0.02"),
    ],
)
def test_resume_refuses_a_changed_compute_dtype_or_aux_coefficient(runs, override, message):
    root, _ = runs
    run = root / "w1"
    TRAIN_JOB.check_run(load_config("tiny-moe", [*BF16, "steps=4"]), run, 2, LaunchOptions(resume=True))
    with pytest.raises(ValueError, match="differs from the run's saved config") as error:
        TRAIN_JOB.check_run(load_config("tiny-moe", [*BF16, override]), run, 1, LaunchOptions(resume=True))
    assert message in str(error.value)
