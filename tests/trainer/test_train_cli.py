"""`titan-audit train` / `replay` end to end: SIGKILL (also inside a checkpoint save) then --resume
gives the uninterrupted trajectory (G5); torchrun launch; elastic replay verdicts; bad input exits 2
before any work."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from distributed import run_ranks

from titan_audit.audit import compare_runs
from titan_audit.cli.main import cli
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.train import train


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "titan_audit.cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _hashes(run, step):
    return json.loads((run / "checkpoints" / f"step_{step:08d}" / "hashes.json").read_text())["tensors"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    done = _cli("train", "--config", "tiny-dense", "--out", str(out), "--steps", "8")
    assert done.returncode == 0, done.stderr
    assert "step 8/8" in done.stderr
    return out


@pytest.mark.parametrize(
    "crash, nproc",
    [("checkpoint.before_rename:8", None), ("train.after_step:6:1", "2")],
    ids=["kill-during-checkpoint-save", "kill-rank1-after-step6-torchrun"],
)
def test_sigkill_then_resume_gives_the_uninterrupted_trajectory(reference, tmp_path, crash, nproc):
    out = tmp_path / "run"
    launch = ["--nproc", nproc] if nproc else []
    killed = _cli(
        "train",
        "--config",
        "tiny-dense",
        "--out",
        str(out),
        "--steps",
        "8",
        *launch,
        env={"TITAN_AUDIT_CRASH_AT": crash},
    )
    assert killed.returncode != 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    if crash.startswith("checkpoint"):
        assert ckpts == [".step_00000008.partial", "step_00000004"]  # the save was cut before its rename
    else:
        assert ckpts == ["step_00000004"]
    resumed = _cli("train", "--out", str(out), "--resume", *launch)
    assert resumed.returncode == 0, resumed.stderr
    assert "step 5/8" in resumed.stderr and "step 4/8" not in resumed.stderr
    result = compare_runs(reference, out)
    assert result.identical and result.compared == result.records_a, result.first_divergence
    assert _hashes(out, 8) == _hashes(reference, 8)
    history = json.loads((out / "manifest.json").read_text())["world_size_history"]
    assert [h["start_step"] for h in history] == [0, 4]


def _train_rank(rank, world_size, config_dict, out):
    train(from_dict(config_dict), out, quiet=True)


def test_replay_cli_verdicts(reference, tmp_path):
    """`replay --verify-to` says identical (exit 0) for a batch-invariant run replayed at another
    world size, and DIFFERENT (exit 1, naming the first divergence) for a conventional one."""
    same = _cli(
        "replay",
        str(reference),
        "--from-step",
        "4",
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "r2"),
        "--verify-to",
        "6",
        "--json",
    )
    assert same.returncode == 0, same.stderr
    verdict = json.loads(same.stdout)
    assert verdict["verdict"] == "identical" and verdict["to_step"] == 6 and verdict["comparison"]["compared"] > 0
    # negative control: a conventional run (plain all_reduce at W=2) replayed at W=1 is found different;
    # the run is trained on two spawned gloo ranks (the train CLI and torchrun are tested above)
    plain = tmp_path / "plain"
    config = load_config("tiny-dense", ["steps=5", "determinism.enabled=false"])
    run_ranks(_train_rank, 2, args=(to_dict(config), str(plain)))
    differ = _cli("replay", str(plain), "--from-step", "4", "--out", str(tmp_path / "p1"), "--verify-to", "5")
    assert differ.returncode == 1, differ.stderr
    assert "DIFFERENT" in differ.stdout and "first divergence: step 5 phase grad" in differ.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "tiny-dense", "--nproc", "3"], "does not divide the number of virtual microbatches V = 8"),
        (["--config", "tiny-dense", "--set", "data.foo=1"], "unknown key 'data.foo'"),
        (["--config", "tiny-dense", "--set", "parallel.threads=0"], "parallel.threads must be >= 1"),
        (["--config", "nope.toml"], "nope.toml: no such config file"),
        (["--resume"], "run: no such run directory"),
    ],
)
def test_bad_input_exits_2_before_any_work(tmp_path, args, message):
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "tiny-dense"], "holds a run; use --resume to continue it or --overwrite"),
        (["--resume", "--set", "optimizer.lr=0.1"], "optimizer.lr: 0.003 -> 0.1"),
        (["--config", "tiny-moe", "--resume"], "model.preset: 'tiny-dense' -> 'tiny-moe'"),
        (["--resume", "--nproc", "3"], "does not divide"),
    ],
)
def test_bad_input_on_an_existing_run_exits_2_and_leaves_it_alone(reference, args, message):
    before = sorted(str(p) for p in reference.rglob("*"))
    result = CliRunner().invoke(cli, ["train", "--out", str(reference), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert sorted(str(p) for p in reference.rglob("*")) == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--from-step", "3"], "no checkpoint at step 3"),
        (["--from-step", "4", "--nproc", "3"], "does not divide"),
        (["--from-step", "4", "--verify-to", "9"], "must lie in 5..8"),
    ],
)
def test_replay_bad_input_exits_2(reference, tmp_path, args, message):
    result = CliRunner().invoke(cli, ["replay", str(reference), "--out", str(tmp_path / "r"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "r").exists()
