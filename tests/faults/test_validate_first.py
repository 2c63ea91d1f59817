"""Issue 23, item 1: everything is validated before anything is moved, locked or written.

Each refusal is exit 2 with one line naming the key, file or run, and the directory tree is byte for
byte what it was (`fault_injection.snapshot`). The property test draws random invalid configs,
output paths and --overwrite modes and asserts the same. Negative controls: a valid config with
--overwrite does move the old run aside (and says where), --overwrite=delete removes it, and a
run's own companion (RUN/compare-default) may live inside it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch.distributed as dist
from click.testing import CliRunner
from fault_injection import one_line_error, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.cli.main import cli
from titan_audit.trainer.launch import LaunchOptions, start
from titan_audit.trainer.run_dir import check_out_path
from titan_audit.trainer.train import TRAIN_JOB

QUICK = ["--config", "tiny-dense", "--steps", "1", "--set", "parallel.threads=1", "--set", "checkpoint.interval=0"]


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A directory holding one finished 1-step run, `runs/a`."""
    root = tmp_path_factory.mktemp("runs")
    done = _cli("train", *QUICK, "--out", root / "a")
    assert done.exit_code == 0, done.output
    return root


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optimizer.lr=nan", "optimizer.lr: expected a finite number, got nan"),
        ("optimizer.lr=inf", "optimizer.lr: expected a finite number, got inf"),
        ("optimizer.eps=0", "optimizer.eps must be > 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0"),
        ("schedule.decay_steps=0", "schedule.decay_steps must be >= 1"),
        ("model.router_aux_loss_coef=-inf", "model.router_aux_loss_coef: expected a finite number"),
    ],
)
def test_a_bad_number_with_overwrite_moves_nothing(runs, override, needle):
    before = snapshot(runs)
    done = _cli("train", *QUICK, "--set", override, "--out", runs / "a", "--overwrite")
    one_line_error(done, needle)
    assert snapshot(runs) == before


def test_a_store_too_small_for_the_plan_leaves_no_stub(tmp_path):
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(f'{{"text": "hello {i}"}}\n' for i in range(3)))
    assert _cli("data", "prepare", corpus, "--out", tmp_path / "small.zarr").exit_code == 0
    before = snapshot(tmp_path)
    done = _cli("train", *QUICK, "--set", f"data.store={tmp_path / 'small.zarr'}", "--out", tmp_path / "run")
    one_line_error(done, "data.store:", "cannot fill")
    assert snapshot(tmp_path) == before  # no RUN/manifest.json stub


def test_an_out_inside_a_run_is_refused_naming_it(runs):
    before = snapshot(runs)
    for extra in ([], ["--overwrite"]):
        done = _cli("train", *QUICK, "--out", runs / "a" / "audit", *extra)
        one_line_error(done, "inside the run", str(runs / "a"))
    assert snapshot(runs) == before


def test_overwrite_of_a_directory_holding_runs_is_refused(runs):
    before = snapshot(runs)
    one_line_error(_cli("train", *QUICK, "--out", runs, "--overwrite"), "holds the run", str(runs / "a"))
    assert snapshot(runs) == before


def test_a_runs_companion_may_live_inside_it(runs, tmp_path):
    check_out_path(runs / "a" / "compare-default", overwrite=False)  # verify-onpolicy --compare-default
    with pytest.raises(ValueError, match="inside the run"):
        check_out_path(runs / "a" / "compare-default" / "x", overwrite=False)


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_on_a_cpu_build_is_one_line(tmp_path):
    done = _cli("train", *QUICK, "--nproc", "2", "--set", "parallel.backend=nccl", "--out", tmp_path / "r")
    one_line_error(done, "parallel.backend = 'nccl'", "no NCCL")
    assert not (tmp_path / "r").exists()


def test_overwrite_says_where_the_old_run_went_and_delete_removes_it(tmp_path):
    """The negative control of the refusals above: a valid --overwrite does replace the run."""
    run = tmp_path / "r"
    assert _cli("train", *QUICK, "--out", run).exit_code == 0
    moved = _cli("train", *QUICK, "--out", run, "--overwrite")
    assert moved.exit_code == 0, moved.output
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("r.replaced-")]
    assert len(aside) == 1 and (aside[0] / "manifest.json").is_file()
    assert f"now in {aside[0]}" in moved.stderr
    deleted = _cli("train", *QUICK, "--out", run, "--overwrite=delete")
    assert deleted.exit_code == 0, deleted.output
    assert "--overwrite=delete: removed the old contents of" in deleted.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r", aside[0].name])
    unknown_mode = _cli("train", *QUICK, "--out", run, "--overwrite=keep")  # click's usage error
    assert unknown_mode.exit_code == 2 and "'keep' is not one of 'move', 'delete'" in unknown_mode.stderr


# ------------------------------------------------------------------ the property
_POSITIVE_INTS = [
    "steps",
    "data.seq_len",
    "data.global_batch_size",
    "data.microbatch_size",
    "data.synthetic_records",
    "checkpoint.keep_last",
    "audit.flush_every_steps",
    "parallel.threads",
]
_NATURAL_INTS = ["seed", "checkpoint.interval", "schedule.warmup_steps", "data.workers"]
_FLOATS = {  # key -> a predicate of the valid values
    "optimizer.lr": lambda x: x > 0,
    "optimizer.eps": lambda x: x > 0,
    "optimizer.weight_decay": lambda x: 0 <= x < 1 / 3e-3,
    "optimizer.grad_clip": lambda x: x >= 0,
    "schedule.min_lr_ratio": lambda x: 0 <= x <= 1,
}


def _invalid_override() -> st.SearchStrategy[str]:
    bad_positive = st.tuples(st.sampled_from(_POSITIVE_INTS), st.integers(-(10**6), 0))
    bad_natural = st.tuples(st.sampled_from(_NATURAL_INTS), st.integers(-(10**6), -1))
    bad_float = st.sampled_from(sorted(_FLOATS)).flatmap(
        lambda key: st.tuples(
            st.just(key),
            st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not (math.isfinite(x) and _FLOATS[key](x))),
        )
    )
    wrong_type = st.tuples(st.sampled_from(_POSITIVE_INTS + _NATURAL_INTS), st.sampled_from(['"8"', "true", "1.5"]))
    unknown = st.tuples(
        st.sampled_from(["optimizer.lrr", "data.seqlen", "nosuch", "model.overrides.nosuch"]), st.just("1")
    )
    pair = st.one_of(bad_positive, bad_natural, bad_float, wrong_type, unknown)
    return pair.map(lambda kv: f"{kv[0]}={kv[1] if isinstance(kv[1], str) else repr(kv[1])}")


@settings(max_examples=60)
@given(
    override=_invalid_override(),
    target=st.sampled_from(["a", "new", "a/audit", "."]),
    overwrite=st.sampled_from([False, "move", "delete"]),
)
def test_random_invalid_configs_leave_the_directory_unchanged(runs, override, target, overwrite):
    before = snapshot(runs)
    out = runs / target
    overrides = ["parallel.threads=1", override]
    with pytest.raises(ValueError):
        start(TRAIN_JOB, "tiny-dense", out, nproc=None, overrides=overrides, options=LaunchOptions(overwrite=overwrite))
    assert snapshot(runs) == before
