"""compare_runs: the first divergence in execution order for injected one-ULP perturbations."""

import json
import tempfile
from pathlib import Path

import pytest
from audit._audit_runs import MODULE_NAMES, PARAM_NAMES, Perturb, train
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.audit import AuditLogWriter, compare_runs
from titan_audit.deterministic import fingerprint as numerics_fingerprint

STEPS, MICROBATCHES = 3, 2


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("baseline")
    train(run, steps=STEPS, microbatches=MICROBATCHES)
    return run


def _perturbed(perturb: Perturb, **kwargs):
    tmp = tempfile.TemporaryDirectory(prefix="titan-audit-test-")
    train(tmp.name, steps=STEPS, microbatches=MICROBATCHES, perturb=perturb, **kwargs)
    return tmp


def _first(result) -> tuple:
    f = result.first_divergence
    return (f["kind"], f["step"], f["phase"], f["microbatch"], f["name"])


def test_identical_runs_compare_equal(baseline, tmp_path):
    train(tmp_path, steps=STEPS, microbatches=MICROBATCHES)  # a second, independent run of the same recipe
    result = compare_runs(baseline, tmp_path)
    assert result.identical and result.first_divergence is None
    assert result.differing == result.only_in_a == result.only_in_b == 0
    assert result.compared == result.records_a == result.records_b > 300
    assert result.spread == []


@settings(max_examples=12)
@given(step=st.integers(0, STEPS - 1), module=st.sampled_from(MODULE_NAMES), mb=st.integers(0, MICROBATCHES - 1))
def test_perturbed_module_output_is_the_first_divergence(baseline, step, module, mb):
    with _perturbed(Perturb("forward", step, module, mb)) as run:
        result = compare_runs(baseline, run)
    assert _first(result) == ("hash", step, "forward", mb, module)
    assert not result.identical
    assert result.spread[0]["step"] == step and result.spread[0]["differing"] >= 1
    assert all(row["differing"] == 0 for row in result.spread if row["step"] < step)


@settings(max_examples=6)
@given(step=st.integers(0, STEPS - 1), param=st.sampled_from(PARAM_NAMES))
def test_perturbed_gradient_is_the_first_divergence(baseline, step, param):
    with _perturbed(Perturb("grad", step, param)) as run:
        result = compare_runs(baseline, run)
    assert _first(result) == ("hash", step, "grad", -1, param)


@settings(max_examples=6)
@given(step=st.integers(0, STEPS - 1), param=st.sampled_from(PARAM_NAMES))
def test_perturbed_optimizer_state_is_the_first_divergence(baseline, step, param):
    with _perturbed(Perturb("optim", step, param)) as run:
        result = compare_runs(baseline, run)
    assert _first(result) == ("hash", step, "optim", -1, f"{param}.exp_avg")


@settings(max_examples=4)
@given(step=st.integers(0, STEPS - 1), mb=st.integers(0, MICROBATCHES - 1))
def test_different_data_batch_is_the_first_divergence(baseline, step, mb):
    with _perturbed(Perturb("data", step, "", mb)) as run:
        result = compare_runs(baseline, run)
    assert _first(result) == ("hash", step, "data", mb, "input_ids")


def test_spread_counts_every_later_step(baseline):
    with _perturbed(Perturb("data", 0, "", 1)) as run:
        result = compare_runs(baseline, run)
    assert [row["step"] for row in result.spread] == [0, 1, 2]
    # another batch changes every gradient, so from step 1 on every record of the step differs
    # (all but the data batches and the optimizer step counters)
    assert result.spread[1]["differing"] == result.spread[1]["compared"] - MICROBATCHES - len(PARAM_NAMES)
    assert sum(row["differing"] for row in result.spread) == result.differing


def test_dumps_give_elementwise_stats(tmp_path):
    train(tmp_path / "a", steps=2, dump_names=["blocks.1.fc1"])
    train(tmp_path / "b", steps=2, dump_names=["blocks.1.fc1"], perturb=Perturb("forward", 1, "blocks.1.fc1", 0))
    first = compare_runs(tmp_path / "a", tmp_path / "b").first_divergence
    assert (first["step"], first["phase"], first["name"]) == (1, "forward", "blocks.1.fc1")
    dump = first["dump_diff"]
    assert dump["differing_elements"] == 1 and dump["max_ulp"] == 1 and dump["first_index"] == [0, 0, 0]
    assert 0 < dump["max_abs_diff"] < 1e-6
    # without dumps for that record: no element stats
    with _perturbed(Perturb("forward", 1, "blocks.0.fc1", 0), dump_names=["blocks.1.fc1"]) as run:
        assert compare_runs(tmp_path / "a", run).first_divergence["dump_diff"] is None


def test_records_in_one_run_only_are_reported(baseline, tmp_path):
    train(tmp_path / "short", steps=STEPS - 1, microbatches=MICROBATCHES)
    result = compare_runs(baseline, tmp_path / "short")
    assert not result.identical and result.differing == 0
    assert result.only_in_a > 0 and result.only_in_b == 0
    assert _first(result)[:3] == ("only_in_a", STEPS - 1, "data")
    assert result.only_in_a_examples[0]["step"] == STEPS - 1
    # fewer modules recorded in B: their records are in A only, from the first step
    train(tmp_path / "fewer", steps=STEPS, microbatches=MICROBATCHES, modules=("blocks.*",))
    result = compare_runs(baseline, tmp_path / "fewer")
    assert _first(result) == ("only_in_a", 0, "forward", 0, "embed")
    reverse = compare_runs(tmp_path / "fewer", baseline)
    assert reverse.only_in_b == result.only_in_a and _first(reverse)[0] == "only_in_b"


def test_filters(baseline):
    with _perturbed(Perturb("data", 1, "", 0)) as run:
        grads = compare_runs(baseline, run, phase="grad")
        assert _first(grads) == ("hash", 1, "grad", -1, "embed.weight")  # parameter order
        assert grads.compared == STEPS * len(PARAM_NAMES)
        params = compare_runs(baseline, run, phase="param", names="blocks.*")
        assert _first(params) == ("hash", 1, "param", -1, "blocks.0.norm.weight")
        assert params.compared == STEPS * (len(PARAM_NAMES) - 3)
        assert compare_runs(baseline, run, phase="data", names="*ids").differing == 1
        assert compare_runs(baseline, run, phase="forward", names="head").first_divergence["step"] == 1
    with pytest.raises(ValueError, match="unknown audit phase"):
        compare_runs(baseline, baseline, phase="fwd")


def _one(run, step, name, digest, rank=0):
    AuditLogWriter(run, rank=rank).write(
        {
            "step": [step],
            "phase": ["param"],
            "microbatch": [-1],
            "name": [name],
            "dtype": ["float32"],
            "shape": ["[]"],
            "hash": [digest],
            "absmax": [0.0],
            "mean": [0.0],
            "rank": [rank],
            "seq": [0],
        }
    )


def test_repeated_records_count_once_unless_they_conflict(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _one(a, 0, "w", "1" * 32)
    _one(b, 0, "w", "1" * 32)
    _one(b, 0, "w", "1" * 32)  # a resumed run replaying step 0 faithfully
    assert compare_runs(a, b).identical
    _one(b, 0, "w", "2" * 32, rank=1)  # ... or a rank that disagrees
    result = compare_runs(a, b)
    assert not result.identical and result.conflicts_b == 1
    assert _first(result)[0] == "conflict_in_b"
    assert result.first_divergence["b"]["conflicting_hashes"] == ["1" * 32, "2" * 32]


def _manifest(run: Path, **changes):
    fp = numerics_fingerprint("cpu").to_dict()
    fp.update(changes)
    (run / "manifest.json").write_text(json.dumps({"format": 1, "fingerprint": fp}))


def test_incompatible_fingerprints_warn_but_still_compare(baseline, tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(baseline, a)
    shutil.copytree(baseline, b)
    result = compare_runs(a, b)
    assert result.identical and result.fingerprint_note and not result.fingerprint_warnings
    _manifest(a)
    _manifest(b)
    result = compare_runs(a, b)
    assert result.fingerprint_note is None and result.fingerprint_warnings == []
    _manifest(b, num_threads=123)
    result = compare_runs(a, b)
    assert result.identical
    assert any("num_threads" in w for w in result.fingerprint_warnings)


def test_json_is_one_object_with_stable_keys(baseline):
    with _perturbed(Perturb("forward", 0, "head", 0)) as run:
        data = compare_runs(baseline, run).to_dict()
    text = json.dumps(data, allow_nan=False)  # strict JSON: no NaN literals
    assert list(json.loads(text)) == [
        "identical",
        "run_a",
        "run_b",
        "filters",
        "records_a",
        "records_b",
        "compared",
        "differing",
        "only_in_a",
        "only_in_b",
        "conflicts_a",
        "conflicts_b",
        "first_divergence",
        "spread",
        "only_in_a_examples",
        "only_in_b_examples",
        "fingerprint_warnings",
        "fingerprint_note",
        "config_differences",
        "phase_order",
    ]
    assert data["phase_order"] == [
        "rollout",
        "data",
        "forward",
        "logprob",
        "loss",
        "backward",
        "grad",
        "optim",
        "param",
        "ckpt",
    ]
