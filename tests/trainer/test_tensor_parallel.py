"""Tensor parallelism (issue 25): in batch-invariant mode a run has the same audit log, record for
record, at every (dp, tp) layout: tiny-dense (float32) and tiny-moe (bfloat16) at (1,1), (2,1),
(1,2), (2,2), tiny-dense bfloat16 at (1,2), and FSDP2 x TP at (2,2); a TP=2 checkpoint replays
at TP=1 and at W=2 DP. Negative controls, each a difference the test constructs: the same
comparison with the TP=1 run in gemm order v1 (one chain over K instead of the v2 tree the TP
shards reproduce) finds the TP=2 run different at step 1; at TP=4 the sequential sum of the
row-wise partial sums differs from the unsharded gemm while the fixed tree matches it; layouts
off the rule are refused by name. Native kernels at TP=2 (DTensor-style plain all_reduce of the
partial sums, the library's gemm) run and record the TP=1 run's records; whether their bits
differ is the library's business, reported as a property of the test, not asserted.

One shared grid: three process groups (W = 2, 4, 1, in that order), each running its runs one
after the other, so the suite pays three process start-ups.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from distributed import run_ranks

from titan_audit import batch_invariant
from titan_audit.audit import compare_runs, read_audit_log
from titan_audit.cli.main import cli
from titan_audit.models.tensor_parallel import reduce_partials
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.replay import compare_replay, prepare_replay
from titan_audit.trainer.tensor_parallel import check_layout, check_tensor_parallel
from titan_audit.trainer.train import train

pytestmark = pytest.mark.slow

BASE = ["steps=2", "checkpoint.interval=1", "determinism.batch_invariant=true", "data.global_batch_size=4"]
RUNS = {  # name: (recipe, overrides, world size)
    "dense-11": ("tiny-dense", [], 1),
    "dense-21": ("tiny-dense", [], 2),
    "dense-12": ("tiny-dense", ["parallel.tp=2"], 2),
    "dense-22": ("tiny-dense", ["parallel.tp=2"], 4),
    "dense-fsdp-22": ("tiny-dense", ["parallel.tp=2", "parallel.mode=fsdp"], 4),
    "dense-bf16-11": ("tiny-dense", ["model.compute_dtype=bfloat16"], 1),
    "dense-bf16-12": ("tiny-dense", ["model.compute_dtype=bfloat16", "parallel.tp=2"], 2),
    "moe-bf16-11": ("tiny-moe", ["model.compute_dtype=bfloat16"], 1),
    "moe-bf16-21": ("tiny-moe", ["model.compute_dtype=bfloat16"], 2),
    "moe-bf16-12": ("tiny-moe", ["model.compute_dtype=bfloat16", "parallel.tp=2"], 2),
    "moe-bf16-22": ("tiny-moe", ["model.compute_dtype=bfloat16", "parallel.tp=2"], 4),
    "dense-v1-11": ("tiny-dense", ["determinism.bi_kernels=v1"], 1),
    "native-11": ("tiny-dense", ["determinism.batch_invariant=false"], 1),
    "native-12": ("tiny-dense", ["determinism.batch_invariant=false", "parallel.tp=2"], 2),
}
ROW_K, ROW_N, ROW_M = 256, 64, 32  # a row-wise linear whose K = 256 is 4 gemm blocks of 64


def _config(name):
    recipe, overrides, _ = RUNS[name]
    return to_dict(load_config(recipe, [*BASE, *overrides]))


def _grid_rank(rank, world_size, jobs):
    """Each job in order on this process group: a train run ("train", config, out), a replay of a
    run's checkpoint at tp = 1 ("replay", source run, step, out), or the TP=4 partial-sums check
    ("partials",)."""
    out = {}
    for kind, *args in jobs:
        if kind == "train":
            config, run_dir = args
            train(from_dict(config), run_dir, quiet=True)
        elif kind == "replay":
            source, step, run_dir = args
            if rank == 0:
                prepare_replay(source, step, run_dir)
            dist.barrier()
            config = json.loads((Path(run_dir) / "manifest.json").read_text())["config"]
            config["parallel"]["tp"] = 1  # a layout: resume-mutable, the checkpoint reshards
            train(from_dict(config), run_dir, quiet=True, resume=True)
        else:
            out["partials"] = _row_partials(rank, world_size)
    return out


def _row_partials(rank, world_size):
    """A row-wise linear's partial sums over K/4 (BI, v2 gemm) combined by the fixed tree and
    sequentially (rank order, from an all_gather), as raw bits, with the unsharded product."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROW_M, ROW_K, generator=g)
    w = torch.randn(ROW_N, ROW_K, generator=g)
    lo, hi = rank * ROW_K // world_size, (rank + 1) * ROW_K // world_size
    with batch_invariant.enabled():
        whole = batch_invariant.mm(x, w.t())
        partial = batch_invariant.mm(x[:, lo:hi].contiguous(), w[:, lo:hi].t())
        tree = reduce_partials(partial, dist.group.WORLD)
    gathered = [torch.empty_like(partial) for _ in range(world_size)]
    dist.all_gather(gathered, partial)
    sequential = gathered[0]
    for other in gathered[1:]:
        sequential = sequential + other
    return {
        "whole": whole.view(torch.int32),
        "tree": tree.view(torch.int32),
        "sequential": sequential.view(torch.int32),
    }


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-grid")
    jobs = {w: [("train", _config(n), str(root / n)) for n, (_, _, size) in RUNS.items() if size == w] for w in RUNS_W}
    source = str(root / "dense-12")
    run_ranks(_grid_rank, 2, args=([*jobs[2], ("replay", source, 1, str(root / "replay-dp2"))],))
    partials = run_ranks(_grid_rank, 4, args=([*jobs[4], ("partials",)],))
    run_ranks(_grid_rank, 1, args=([*jobs[1], ("replay", source, 1, str(root / "replay-tp1"))],))
    return root, [p["partials"] for p in partials]


RUNS_W = (2, 4, 1)


def _identical(root, a, b):
    result = compare_runs(root / a, root / b)
    assert result.identical, (a, b, result.first_divergence)
    assert result.compared == result.records_a == result.records_b > 0
    return result


LAYOUTS = [("dense", ("21", "12", "22")), ("moe-bf16", ("21", "12", "22")), ("dense-bf16", ("12",))]


@pytest.mark.parametrize(("model", "layouts"), LAYOUTS)
def test_every_dp_x_tp_layout_has_the_tp1_audit_log(grid, model, layouts):
    root, _ = grid
    for layout in layouts:
        _identical(root, f"{model}-11", f"{model}-{layout}")
    last = root / f"{model}-{layouts[-1]}"
    phases = set(read_audit_log(last, columns=["phase"])["phase"].to_pylist())
    assert {"data", "loss", "grad", "optim", "param"} <= phases, phases
    mesh = json.loads((last / "manifest.json").read_text())["world_size_history"][0]["mesh"]
    assert mesh == {"device_type": "cpu", "dp": int(layouts[-1][0]), "tp": int(layouts[-1][1])}


def test_fsdp2_x_tp_has_the_tp1_audit_log(grid):
    root, _ = grid
    _identical(root, "dense-11", "dense-fsdp-22")


def test_a_tp2_checkpoint_replays_at_tp1_and_at_w2_dp(grid):
    root, _ = grid
    for replay in ("replay-tp1", "replay-dp2"):
        result = compare_replay(root / "dense-12", root / replay, 1, 2)
        assert result.identical and result.compared > 0, (replay, result.first_divergence)
        assert compare_replay(root / "dense-11", root / replay, 1, 2).identical
    mesh = json.loads((root / "replay-dp2" / "manifest.json").read_text())["world_size_history"][-1]["mesh"]
    assert mesh == {"device_type": "cpu", "dp": 2, "tp": 1}


def test_negative_control_the_tp1_run_in_another_gemm_order_differs(grid):
    root, _ = grid
    first = compare_runs(root / "dense-v1-11", root / "dense-12").first_divergence
    assert first is not None and first["step"] == 1, first


def test_native_kernels_at_tp2_record_the_tp1_runs_records(grid, record_property):
    root, _ = grid
    result = compare_runs(root / "native-11", root / "native-12")
    assert result.compared == result.records_a == result.records_b > 0
    assert result.only_in_a == result.only_in_b == 0
    record_property("native_tp2_differing_records", result.differing)  # the library's bits: reported


def test_compare_names_the_cause_before_a_native_tp_divergence(grid):
    """`titan-audit compare` of native TP=1 vs TP=2 warns first that the layout differs outside BI
    mode; the BI-mode pair (control) gets no warning."""
    root, _ = grid
    native = CliRunner().invoke(cli, ["compare", str(root / "native-11"), str(root / "native-12")])
    assert native.exit_code in (0, 1), native.output
    first = native.output.splitlines()[0]
    assert first.startswith("warning: bitwise equality is not expected") and "parallel.tp: 1 -> 2" in first, first
    as_json = CliRunner().invoke(cli, ["compare", str(root / "native-11"), str(root / "native-12"), "--json"])
    assert len(json.loads(as_json.output)["expected_differences"]) == 1
    bi = CliRunner().invoke(cli, ["compare", str(root / "dense-11"), str(root / "dense-12")])
    assert bi.exit_code == 0, bi.output
    assert "warning" not in bi.output and "not expected" not in bi.output, bi.output


def test_at_tp4_the_fixed_tree_gives_the_unsharded_gemm_and_a_sequential_sum_does_not(grid):
    _, partials = grid
    for rank in partials:
        assert torch.equal(rank["tree"], rank["whole"])  # raw bits
        assert torch.equal(rank["sequential"], partials[0]["sequential"])
    assert all(torch.equal(r["tree"], partials[0]["tree"]) for r in partials)  # the same on every rank
    assert not torch.equal(partials[0]["sequential"], partials[0]["whole"])  # negative control


@pytest.mark.parametrize(
    ("overrides", "tp", "named"),
    [
        ([], 4, "model.num_key_value_heads = 2"),
        (
            ["model.overrides.num_key_value_heads=4", "model.overrides.intermediate_size=192"],
            4,
            "model.intermediate_size = 192",
        ),
        (["determinism.bi_kernels=v1"], 2, "determinism.bi_kernels = 'v2'"),
        (["audit.level=full"], 2, "audit.level = 'full'"),
    ],
)
def test_a_layout_off_the_rule_is_refused_naming_the_key(overrides, tp, named):
    config = load_config("tiny-dense", [*BASE, *overrides, f"parallel.tp={tp}"])
    with pytest.raises(ValueError, match=re.escape(named)):
        check_tensor_parallel(config)


def test_the_rule_on_the_block_grid():
    config = load_config("tiny-dense").model.model_config()
    check_layout(config, 2)  # every sharded dimension: P(K) in {2, 4, 8, 32}, divisible by 2
    narrow = dataclasses.replace(config, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    check_layout(narrow, 2)
    with pytest.raises(ValueError, match=re.escape("model.num_key_value_heads * head_dim = 128 is summed in 2 block")):
        check_layout(narrow, 4)  # 4 kv heads of 32: a shard of 32 is half a gemm block
    with pytest.raises(ValueError, match="world size 3 is not a multiple of parallel.tp = 2"):
        load_config("tiny-dense", ["parallel.tp=2"]).check_world_size(3)
