"""`bench audit` smoke test: the suite runs on every core and reports params/full vs off ratios
(no timing asserted), and its FSDP2 and DDP cases count the bytes each rank hashes and receives (exact
identities on the counters); the real-width case's model has qwen3-0.6b's widths."""

import os

import pytest
import torch
from distributed import run_ranks

from titan_audit.bench import BenchOptions, audit_suite, run_suite
from titan_audit.models.presets import get_preset
from titan_audit.trainer import local_ranks

FSDP = "FSDP2 W=2 vs W=1, audit params: bytes hashed per rank per step"
DDP = "DDP W=2 vs W=1, audit params: bytes hashed per rank per step"


@pytest.fixture(scope="module")
def quick():  # one quick run of the suite for the module: ~15-25 s on 2 shared cores
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_ranks, "run_local_ranks", run_ranks)  # the W=1/W=2 ranks forked, not spawned
        data = run_suite("audit", BenchOptions(quick=True, repeats=1, min_batch_s=0.001)).to_dict()
    assert torch.get_num_threads() == threads, "the suite restores the thread count"
    return {c["case"]: c for c in data["cases"]}


def test_bench_audit_quick_reports_both_levels_on_every_core(quick):
    cases = dict(quick)
    resume = cases.pop("resume check of the audit log, 10000 steps vs 20")  # --quick: 10^4 steps
    assert resume["long_parts_read"] == resume["short_parts_read"] and resume["long_parts"] > 100
    cases.pop(FSDP)
    cases.pop(DDP)
    assert set(cases) == {"small-transformer step, audit params vs off", "small-transformer step, audit full vs off"}
    for case in cases.values():
        assert case["baseline"] == "Recorder level off"
        assert case["ratio"] == case["candidate_s"] / case["baseline_s"] > 0
        assert case["off_again_ratio"] > 0 and case["ratio_of_minima"] > 0 and case["paired_ratio"] > 0
        assert case["off_again_paired_ratio"] > 0
        assert case["threads"] == audit_suite.all_cores() == len(os.sched_getaffinity(0))
    assert cases["small-transformer step, audit params vs off"]["target"] == 1.03
    assert cases["small-transformer step, audit full vs off"]["target"] == 1.10


def test_fsdp2_w2_ranks_hash_their_shards_and_receive_lanes_not_tensors(quick):
    case = quick[FSDP]
    w1, w2 = case["hashed_bytes_per_rank_w1"], case["hashed_bytes_per_rank_w2"]
    assert case["baseline_bytes"] == w1[0] and case["candidate_bytes"] == max(w2)
    assert max(w2) < 0.6 * w1[0] and case["met_target"]  # each rank hashes about half
    # every byte hashed once: the shards add up to the W=1 tensors; the one extra is rank 1's own
    # microbatch (its input ids and loss; W=1 ran one microbatch per step too)
    batch = audit_suite.FSDP_BATCH_QUICK
    assert sum(w2) == w1[0] + batch[0] * batch[1] * 8 + 4
    assert case["received_bytes_per_rank_w1"] == [0]  # control: one rank receives nothing
    received_0, received_1 = case["received_bytes_per_rank_w2"]
    assert received_1 == 0  # rank 0 writes the step-level records: rank 1 receives nothing
    assert case["lattice_records_w2"] > 0 and case["received_bytes_per_lattice_record_w2"] == 5 * 8
    assert case["gathered_records_w2"] > 0  # tensors of at most C come to the writer whole
    lattice = case["lattice_records_w2"] * case["received_bytes_per_lattice_record_w2"]
    assert received_0 == lattice + case["gathered_records_w2"] * case["received_bytes_per_gathered_record_w2"]
    assert case["full_tensor_calls"] == 0


def test_ddp_w2_replicas_split_the_tensors_above_c_and_the_writer_keeps_the_small_ones(quick):
    case = quick[DDP]
    w1, w2 = case["hashed_bytes_per_rank_w1"], case["hashed_bytes_per_rank_w2"]
    assert max(w2) < 0.6 * w1[0] and case["met_target"]
    batch = audit_suite.FSDP_BATCH_QUICK
    assert sum(w2) == w1[0] + batch[0] * batch[1] * 8 + 4  # every byte once, plus rank 1's microbatch
    received_0, received_1 = case["received_bytes_per_rank_w2"]
    assert received_1 == 0 and case["gathered_records_w2"] == 0  # the writer holds the small tensors
    assert case["lattice_records_w2"] > 0 and received_0 == case["lattice_records_w2"] * 5 * 8
    assert case["full_tensor_calls"] == 0


def test_real_width_case_has_the_qwen3_widths_and_is_left_out_of_quick(quick):
    config, preset = audit_suite.real_width_config(), get_preset("qwen3-0.6b")
    fields = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    )
    assert (
        [getattr(config, f) for f in fields] == [getattr(preset, f) for f in fields] == [1024, 3072, 16, 8, 128, 151936]
    )
    assert config.num_hidden_layers == 2 and config.tie_word_embeddings
    assert not any(name.startswith(audit_suite.REAL_WIDTH_CASE) for name in quick)
    assert audit_suite.TARGETS["real_width_params"] == 1.10


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_orders_put_each_side_after_each_other_equally_often(n):
    """Control (n >= 3): rotating one order (what the suite did before) only ever puts side
    i + 1 after side i: n of the n(n - 1) ordered pairs."""
    from collections import Counter

    from titan_audit.bench.audit_suite import balanced_orders

    def follows(orders):
        return Counter((o[i], o[i + 1]) for o in orders for i in range(len(o) - 1))

    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders)
    counts = follows(orders)
    assert len(counts) == n * (n - 1) and len(set(counts.values())) == 1
    rotated = [list(range(r, n)) + list(range(r)) for r in range(n)]
    assert len(follows(rotated)) == n if n >= 3 else follows(rotated) == counts


def test_paired_ratio_is_the_median_of_each_repeats_ratio():
    """paired_ratio pairs repeat r of one side with repeat r of `off`: a machine that slows
    down tenfold between repeats leaves it at the sides' true ratio; sides of different lengths
    are refused."""
    off = [1.0, 1.0, 10.0, 10.0, 10.0, 1.0]
    assert audit_suite.paired_ratio([2 * t for t in off], off) == 2.0
    assert audit_suite.paired_ratio([1.0, 1.5, 10.0, 30.0, 10.0, 1.0], off) == 1.0  # the median
    with pytest.raises(ValueError):
        audit_suite.paired_ratio([1.0], off)
