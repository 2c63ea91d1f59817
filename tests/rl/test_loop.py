"""The RL loop (rl/loop.py, rl/rollouts.py): zero gap at lag 0, deterministic lag under random
delays, weight-sync fingerprints, reward errors, kill -9 + resume, and W=1 == W=2.

Every invariance test has a negative control whose difference the test constructs (the generator
sent the trainer's weights one ulp off shows a gap, rl/control.py; another lag gives another
trajectory). Runs start from a model warmed up for a few steps on the synthetic corpus (module
fixture), so rewards vary and the updates are not zero.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from command_line import cli

from titan_audit.audit import compare_runs
from titan_audit.rl import rollout_schedule
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.config import load_rl_config
from titan_audit.rl.loop import rl_train
from titan_audit.rl.rollouts import DELAY_ENV, RolloutWorker, WeightSyncError, rollout_version
from titan_audit.rl.tasks import RewardError, Task, register_task

SMALL = [
    'task.name="reversal"',
    "task.prompts_per_step=2",
    "task.samples_per_prompt=4",
    "sampling.max_new_tokens=6",
    "optimizer.lr=1e-3",
    "checkpoint.interval=2",
]


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """tiny-dense after 20 training steps on the synthetic tasks (knows the formats, barely)."""
    out = tmp_path_factory.mktemp("warm") / "run"
    proc = cli(
        "train",
        "--config",
        "tiny-dense",
        "--steps",
        "20",
        "--out",
        str(out),
        "--set",
        "checkpoint.interval=0",
        "--set",
        "data.synthetic_records=512",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def metrics(run: Path) -> list[dict]:
    return pq.read_table(run / "metrics.parquet").to_pylist()


def config(*extra: str, steps: int = 3):
    return load_rl_config("rl-tiny", [*SMALL, f"steps={steps}", *extra])


def test_rollout_version_is_the_lag_rule():
    assert [rollout_version(k, 0) for k in range(1, 5)] == [0, 1, 2, 3]
    assert [rollout_version(k, 2) for k in range(1, 7)] == [0, 0, 0, 1, 2, 3]


def test_on_policy_gap_is_zero_and_every_ratio_is_exactly_one(warm, tmp_path):
    """Also under the strict op census: no native op ran in BI mode (it would have stopped the run)."""
    result = rl_train(config("verify=true", 'determinism.census="strict"'), tmp_path / "a", init=warm, quiet=True)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["bi_census"] == {"mode": "strict", "native_ops_seen": {}}
    rows = metrics(tmp_path / "a")
    assert result.max_gap_differing == 0 and len(rows) == 3
    for row in rows:
        assert row["gap_tokens"] > 0 and row["gap_tokens_differing"] == 0
        assert row["gap_max_abs"] == 0.0 and row["gap_k3_kl"] == 0.0
        assert row["ratio_min"] == row["ratio_mean"] == row["ratio_max"] == 1.0
        assert row["policy_age"] == 0
    assert any(row["grad_norm"] > 0 for row in rows), "the test needs a non-zero update"
    params = [r for r in pq.read_table(tmp_path / "a" / "audit").to_pylist() if r["phase"] == "param"]
    assert len({r["hash"] for r in params if r["name"] == "layers.0.mlp.up_proj.weight"}) > 1  # the weights moved


@pytest.mark.control
def test_negative_control_generator_weights_one_ulp_off_show_a_gap(tmp_path):
    """The constructed control (config key `control`): the same 1-step run, once as is (zero gap)
    and once with the generator sent the trainer's weights with one element one ulp off (a gap).
    From the deterministic init, in this process: cheap enough to re-run under every CPU variant."""
    plain = rl_train(config("verify=true", steps=1), tmp_path / "bi", quiet=True)
    control = rl_train(config("verify=true", "control=generator-weight-ulp", steps=1), tmp_path / "c", quiet=True)
    assert plain.max_gap_differing == 0 and metrics(tmp_path / "bi")[0]["gap_tokens"] > 0
    assert control.max_gap_differing > 0
    (row,) = metrics(tmp_path / "c")
    assert 0 < row["gap_max_abs"] < 1e-3 and row["gap_tokens"] == metrics(tmp_path / "bi")[0]["gap_tokens"]
    # the generator's weights the audit records are the ones it was sent: not the trainer's
    digests = [
        {r["hash"] for r in pq.read_table(run / "audit").to_pylist() if r["name"] == "generator_weights"}
        for run in (tmp_path / "bi", tmp_path / "c")
    ]
    assert digests[0] and digests[1] and not digests[0] & digests[1]


def test_the_control_at_lag_one_compares_with_the_trainers_own_weights(warm, tmp_path):
    """At lag > 0 the gap figures come from the worker's same-weights recomputation, which uses the
    trainer's weights, not the perturbed copy the generator got: every step shows the gap."""
    extra = ("rollout.lag=1", "verify=true", "control=generator-weight-ulp")
    rl_train(config(*extra, steps=3), tmp_path / "c", init=warm, quiet=True)
    rows = metrics(tmp_path / "c")
    assert [r["policy_age"] for r in rows] == [0, 1, 1]
    assert all(r["gap_tokens_differing"] > 0 for r in rows), rows


@pytest.mark.parametrize(
    "extra, message",
    [
        (["verify=true", "control=weights"], r"control: 'weights' is not one of 'generator-weight-ulp'"),
        (["control=generator-weight-ulp"], r"control = 'generator-weight-ulp' needs verify = true"),
    ],
)
def test_a_bad_control_is_a_value_error_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        config(*extra)


@pytest.mark.slow
def test_lag_two_with_random_delays_is_identical_to_without(warm, tmp_path, monkeypatch):
    steps = 5
    rl_train(config("rollout.lag=2", "verify=true", steps=steps), tmp_path / "plain", init=warm, quiet=True)
    monkeypatch.setenv(DELAY_ENV, "40")  # random 0..40 ms sleeps in the generator thread and the trainer
    rl_train(config("rollout.lag=2", "verify=true", steps=steps), tmp_path / "delayed", init=warm, quiet=True)
    monkeypatch.delenv(DELAY_ENV)
    result = compare_runs(tmp_path / "plain", tmp_path / "delayed")
    assert result.identical and result.compared > 0, result.first_divergence
    rows = metrics(tmp_path / "plain")
    assert [r["policy_age"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["policy_version"] for r in rows] == [0, 0, 0, 1, 2]
    assert all(r["gap_tokens_differing"] == 0 for r in rows)  # same-weights recomputation: still zero gap
    assert any(r["ratio_min"] != 1.0 for r in rows[3:]), "stale rollouts must give ratios != 1"
    # negative control: another lag is another trajectory, and compare sees it
    rl_train(config("rollout.lag=1", steps=steps), tmp_path / "lag1", init=warm, quiet=True)
    assert not compare_runs(tmp_path / "plain", tmp_path / "lag1").identical


class _ThreadRecordingGenerator(BuiltinGenerator):
    """Records the name of the thread each generate call runs in."""

    threads: list[str] = []

    def generate(self, requests, params):
        self.threads.append(threading.current_thread().name)
        return super().generate(requests, params)


def test_lag_zero_generates_in_the_trainer_thread_with_the_threaded_workers_bits(warm, tmp_path, monkeypatch):
    """At lag 0 no worker thread runs the jobs (rollouts.py: a second OpenMP team made threads=2 slow);
    the run is bitwise the run whose jobs go through the worker thread."""
    factory = lambda model, bi: _ThreadRecordingGenerator(model, BuiltinGeneratorConfig(batch_invariant=bi))  # noqa: E731
    _ThreadRecordingGenerator.threads = []
    rl_train(config(steps=2), tmp_path / "inline", init=warm, quiet=True, generator_factory=factory)
    assert _ThreadRecordingGenerator.threads == ["MainThread", "MainThread"]
    _ThreadRecordingGenerator.threads = []
    threaded = lambda *a, **k: RolloutWorker(*a, **{**k, "threaded": True})  # noqa: E731
    monkeypatch.setattr(rollout_schedule, "RolloutWorker", threaded)
    rl_train(config(steps=2), tmp_path / "threaded", init=warm, quiet=True, generator_factory=factory)
    assert _ThreadRecordingGenerator.threads == ["titan-audit-rollouts"] * 2  # control: the worker thread ran them
    result = compare_runs(tmp_path / "inline", tmp_path / "threaded")
    assert result.identical and result.compared > 0, result.first_divergence


class _CorruptingGenerator(BuiltinGenerator):
    """Loads one tensor wrong at policy version 1 (a broken weight sync)."""

    def load_weights(self, state_dict, policy_version):
        if policy_version == 1:
            state_dict = dict(state_dict)
            state_dict["layers.1.mlp.down_proj.weight"] = state_dict["layers.1.mlp.down_proj.weight"] + 1e-3
        super().load_weights(state_dict, policy_version)


def test_a_weight_sync_mismatch_stops_the_run_naming_the_tensor(warm, tmp_path):
    factory = lambda model, bi: _CorruptingGenerator(model, BuiltinGeneratorConfig(batch_invariant=bi))  # noqa: E731
    with pytest.raises(WeightSyncError, match=r"step 2 \(policy version 1\).*'layers\.1\.mlp\.down_proj\.weight'"):
        rl_train(config(), tmp_path / "w", init=warm, quiet=True, generator_factory=factory)
    assert [r["step"] for r in metrics(tmp_path / "w")] == [1]  # step 1 stands; nothing half-written


def test_a_failing_reward_stops_the_run_naming_task_and_sample(warm, tmp_path):
    def reward(prompt, answer, completion):
        if len(completion) > 2:
            raise ZeroDivisionError("bad reward")
        return 0.0

    register_task(Task("t-loop-raise", lambda rng: f"Reverse: {'abc'} ->", lambda p: "cba", reward))
    with pytest.raises(RewardError, match=r"task 't-loop-raise', step 1, prompt \d, sample \d .*ZeroDivisionError"):
        rl_train(config('task.name="t-loop-raise"'), tmp_path / "r", init=warm, quiet=True)
    assert (tmp_path / "r" / "manifest.json").is_file()


def test_bad_weights_shape_for_init_is_a_value_error(warm, tmp_path):
    with pytest.raises(ValueError, match="another shape.*num_hidden_layers"):
        rl_train(config("model.overrides.num_hidden_layers=2"), tmp_path / "s", init=warm, quiet=True)
    assert not (tmp_path / "s").exists()


def _lag2_args(warm: Path) -> list[str]:
    return [
        "rl",
        "--config",
        "rl-tiny",
        "--init",
        str(warm),
        "--steps",
        "6",
        *[a for s in SMALL for a in ("--set", s)],
        "--set",
        "rollout.lag=2",
    ]


@pytest.fixture(scope="module")
def whole_lag2(warm, tmp_path_factory) -> Path:
    """The uninterrupted 6-step lag-2 run the kill/resume tests compare with."""
    out = tmp_path_factory.mktemp("whole") / "run"
    proc = cli(*_lag2_args(warm), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["rl.after_step:3", "rl.rollout:5", "checkpoint.before_rename:4"])
def test_kill_minus_nine_and_resume_is_the_uninterrupted_run(warm, whole_lag2, tmp_path, crash_at):
    """SIGKILL after a step, inside a rollout (generator thread) and mid-checkpoint, at lag 2 (rollouts
    in flight at every checkpoint), then `--resume`: the same audit records and losses."""
    killed = cli(*_lag2_args(warm), "--out", str(tmp_path / "killed"), env={"TITAN_AUDIT_CRASH_AT": crash_at})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    resumed = cli("rl", "--out", str(tmp_path / "killed"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = compare_runs(whole_lag2, tmp_path / "killed")
    assert result.identical and result.compared > 0, result.first_divergence
    a, b = metrics(whole_lag2), metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.slow
def test_world_size_one_and_two_give_the_same_trajectory(warm, tmp_path):
    """`titan-audit rl --nproc 2` (both ranks generate) has the audit records and losses of the same
    run at W=1 (in this process: the CLI's launch of one rank is tested above)."""
    extra = ("rollout.lag=1", "task.prompts_per_step=4", "task.samples_per_prompt=2")
    rl_train(config(*extra, steps=3), tmp_path / "w1", init=warm, quiet=True)
    args = [
        "rl",
        "--config",
        "rl-tiny",
        "--init",
        str(warm),
        "--steps",
        "3",
        *[a for s in SMALL for a in ("--set", s)],
        *[a for s in extra for a in ("--set", s)],
    ]
    two = cli(*args, "--out", str(tmp_path / "w2"), "--nproc", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "RuntimeWarning" not in two.stderr, two.stderr[-2000:]  # runpy: the rank entry is imported by nothing
    result = compare_runs(tmp_path / "w1", tmp_path / "w2")
    assert result.identical and result.compared > 0, result.first_divergence
    ranks = {r["rank"] for r in pq.read_table(tmp_path / "w2" / "audit").to_pylist() if r["phase"] == "rollout"}
    assert ranks == {0, 1}  # both ranks generated rollouts
    assert [r["loss"] for r in metrics(tmp_path / "w1")] == [r["loss"] for r in metrics(tmp_path / "w2")]
    assert torch.tensor([r["world_size"] for r in metrics(tmp_path / "w2")]).eq(2).all()
