"""`bench memory` (bench/memory_suite.py) and its formula (bench/memory_formula.py): the formula's
counts against the real model and the real gradient pool, docs/memory.md's on-paper table against
the formula, the cases' band and byte keys, the grid's checks, and one real measured point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from titan_audit.bench.core import BenchOptions, MemoryGrid, SuiteResult
from titan_audit.bench.memory_formula import Layout, Shape, estimate, gradient_buffers, paper_table
from titan_audit.bench.memory_suite import DP_GROWTH_DATA, MemoryCase, memory_suite, relation_cases, train_config
from titan_audit.cli.main import cli
from titan_audit.models.presets import PRESETS
from titan_audit.models.transformer import Transformer
from titan_audit.trainer.reduce import TreeReducer
from titan_audit.trainer.step import GradBuffers

DOCS = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def _counts(config) -> tuple[int, int, int, int]:
    with torch.device("meta"):
        model = Transformer(config)
    block = sum(p.numel() for p in model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    return total, max(p.numel() for p in model.parameters()), block, total - len(model.layers) * block


@pytest.mark.parametrize("name", ["tiny-dense", "llama-tiny", "qwen3-0.6b", "50m"])
def test_the_formula_counts_the_models_parameters(name):
    config = train_config(MemoryGrid(), "dp", 2).model.model_config() if name == "50m" else PRESETS[name]
    shape = Shape.of(config)
    assert (shape.params, shape.largest_param, shape.block_params, shape.root_params) == _counts(config)
    if name == "50m":
        assert shape.params == 45_356_032  # P ~ 45.4M, one fp32 copy 181.4 MB


def test_an_moe_model_is_refused():
    with pytest.raises(ValueError, match="dense models; this one has 8 experts"):
        Shape.of(PRESETS["tiny-moe"])


@pytest.mark.parametrize("microbatches", range(1, 17))
def test_g_is_what_the_gradient_pool_lends(microbatches):
    """The trainer's pool and tree at W = 1 (step.StepKit's pattern): exactly g buffers when V is
    a power of two, at most g otherwise (the formula's bound)."""
    pool = GradBuffers(8)
    reducer = TreeReducer(microbatches, release=pool.give)
    for i in range(microbatches):
        reducer.add(i, pool.take())
    pool.give(reducer.all_reduce())
    g = gradient_buffers(microbatches, 1)
    if microbatches & (microbatches - 1) == 0:
        assert pool.peak == g == microbatches.bit_length()
    else:
        assert pool.peak <= g


def test_the_terms_of_each_mode():
    shape = Shape.of(PRESETS["tiny-dense"])
    P, rope = shape.params, 2 * 4 * 2048 * 64  # cos and sin tables, [max_positions, head_dim] float32
    dp = estimate(shape, Layout("dp", 2, 8, 64))
    assert dp.static == {"params": 4 * P, "adamw_states": 8 * P, "gradient_buffers": 3 * 4 * P, "rope_tables": rope}
    assert dp.exchange_per_host == (2 + 1) * 4 * P  # W slots + the gathered vector, one host
    assert dp.phases["reduce"] == {}  # the tree's buffers are the pool's: static
    assert dp.peak == sum(dp.static.values()) + max(dp.phase("backward"), dp.phase("optimizer"))
    fsdp = estimate(shape, Layout("fsdp", 2, 8, 64))
    assert fsdp.static == {  # g - 1 = 2 partials of a shard, FSDP's sharded .grad, at W = 2
        "params": 2 * P,
        "adamw_states": 4 * P,
        "gradient_partials": 2 * 2 * P,
        "fsdp_sharded_grads": 2 * P,
        "rope_tables": rope,
    }
    one_round = estimate(shape, Layout("fsdp", 2, 2, 64)).static  # V = W: one partial, never none
    assert (one_round["gradient_partials"], one_round["fsdp_sharded_grads"]) == (2 * P, 2 * P)
    assert estimate(shape, Layout("fsdp", 1, 8, 64)).static["gradient_partials"] == 4 * 4 * P  # W = 1: g
    assert fsdp.exchange_per_host == 0
    L = shape.largest_group
    assert fsdp.phases["reduce"] == {
        "packed_group_gradient": 4 * L,
        "received_group_pieces": 4 * L,
        "held_gradient": 4 * shape.largest_param,
    }
    assert estimate(shape, Layout("fsdp", 1, 8, 64)).phases["reduce"] == {}  # W = 1: FSDP copies
    assert estimate(shape, Layout("dp", 2, 8, 64, one_host=False)).static["exchange_receive"] == 4 * (P // 2 + P % 2)
    assert estimate(shape, Layout("dp", 1, 8, 64, fused_adamw=True)).phase("optimizer") == 0
    with pytest.raises(ValueError, match="W = 3 does not divide V = 8"):
        Layout("dp", 3, 8, 64)


def test_the_docs_table_is_the_formula():
    assert paper_table() in DOCS.read_text(), "docs/memory.md: paste bench.memory_formula.paper_table() again"


def _case(ratio: float) -> MemoryCase:
    return MemoryCase("c", "formula", "measured", 100, 100 * ratio, ratio, 1.15, target_low=0.85)


def test_a_point_meets_its_band_from_both_sides_and_says_bytes():
    assert [_case(r).met_target for r in (0.84, 0.85, 1.0, 1.15, 1.16)] == [False, True, True, True, False]
    data = SuiteResult("memory", {}, [_case(0.5), _case(1.0)]).to_dict()
    case = data["cases"][0]
    assert {"baseline_bytes", "candidate_bytes", "target_low"} <= set(case) and "baseline_s" not in case
    assert data["summary"]["missed"] == ["c"]


def test_the_memory_goal_relations():
    shape = Shape.of(PRESETS["tiny-dense"])
    copy = 4 * shape.params
    data = 14 * DP_GROWTH_DATA  # V = 2 -> 16: 14 more microbatches' batches
    measured = {("dp", 1, 2): 10 * copy, ("dp", 1, 16): 13 * copy + data, ("fsdp", 1, 8): 1000, ("fsdp", 4, 8): 500}
    growth, shrink = relation_cases(measured, shape)
    assert (growth.ratio, growth.met_target) == (1.0, True) and growth.extra["gradient_copies"] > 3.0
    measured[("dp", 1, 16)] += 1  # control: one byte more than three copies and the data allowance
    assert relation_cases(measured, shape)[0].met_target is False
    assert shrink.extra["fraction_of_w1"] == 0.5 and shrink.met_target is False
    assert relation_cases({("dp", 1, 2): 1}, shape) == []  # only measured points make a relation


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hash", "--modes", "dp"], "--modes apply to the memory suite only"),
        (["memory", "--world-sizes", "4", "--microbatches", "2"], "no memory point"),
        (["memory", "--world-sizes", "two"], "expected comma-separated numbers"),
        (["memory", "--modes", "tp"], "memory modes must be 'dp' and/or 'fsdp'"),
        (["memory", "--memory-steps", "0"], "memory steps must be >= 1"),
    ],
)
def test_bad_grid_options_are_usage_errors(args, message):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_measured_dp_point_is_within_the_band_and_the_exchange_exact():
    """One real launch (torchrun, 2 ranks, tiny-dense, one step) under the tracker."""
    grid = MemoryGrid(modes=("dp",), world_sizes=(2,), microbatches=(2,), model="tiny", steps=1)
    done = []
    (case,) = memory_suite(BenchOptions(memory=grid), done.append)
    assert done == ["memory dp W=2 V=2"]
    assert case.met_target, (case.ratio, case.extra["peak_where"])
    assert case.extra["exchange_mapped_bytes"] == case.extra["exchange_predicted_bytes"] > 0
    assert len(case.extra["peak_live_bytes_per_rank"]) == 2
    assert case.extra["max_rss_bytes"] > case.candidate_s
    assert case.extra["memory_policy"] == {"mallopt_keeps_freed_heap": False, "THP_MEM_ALLOC_ENABLE": "0"}


@pytest.mark.slow  # two torchrun launches of 2 ranks (~15 s each on 2 shared cores): the CLI end to end
def test_bench_memory_quick_json():
    result = CliRunner().invoke(cli, ["bench", "memory", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [c["case"] for c in data["cases"]] == ["memory dp W=2 V=2", "memory fsdp W=2 V=2"]
    for case in data["cases"]:
        assert case["candidate_bytes"] > 0 and case["ratio"] == case["candidate_bytes"] / case["baseline_bytes"]
