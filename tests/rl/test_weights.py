"""The RL trainer's weights (rl/weights.py, rl/init.py): FSDP2 gives the bits of data parallel at
every W, lag 0 runs the generator on the trainer's own tensors with no snapshot, lag 1 keeps one
snapshot per policy version, and weight fingerprints computed on shards equal those of the full
tensors.

Each equality has a constructed negative control: another seed gives other audit records, a
one-element change in one shard changes that tensor's fingerprint (and only its). Runs start from
the deterministic init with a reward that varies with the completion's bytes (registered in every
rank), so advantages and updates are non-zero without a warm-up. Multi-rank work runs in spawned
gloo processes (tests/distributed.py); nothing here leaves a process group in the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import compare_runs
from titan_audit.rl import loop as rl_loop
from titan_audit.rl.config import load_rl_config
from titan_audit.rl.loop import rl_train
from titan_audit.rl.rollouts import RolloutWorker, first_difference
from titan_audit.rl.tasks import Task, register_task

TASK = "t-weights-bytes"
SMALL = [
    f'task.name="{TASK}"',
    "task.prompts_per_step=4",
    "task.samples_per_prompt=2",
    "sampling.max_new_tokens=5",
    "optimizer.lr=1e-2",
    "checkpoint.interval=0",
    "verify=true",
    "loss.kl_coef=0.1",
]


def _register() -> None:
    """A task whose reward depends on the completion's bytes: varied rewards from any init."""
    register_task(
        Task(
            TASK,
            lambda rng: f"Echo: {''.join(chr(97 + int(i)) for i in rng.integers(0, 26, 4))} ->",
            lambda prompt: prompt,
            lambda prompt, answer, completion: (sum(map(ord, completion)) % 7) / 6.0,
        )
    )


def _config(*extra: str, steps: int = 3):
    _register()
    return load_rl_config("rl-tiny", [*SMALL, f"steps={steps}", *extra])


def _runs(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> list[int | None]:
    """Rank entry: each (out, settings) RL run in turn on this process group (2 steps unless the
    settings say); the most tokens with a gap in any step of each."""
    return [rl_train(_config(*settings, steps=2), out, quiet=True).max_gap_differing for out, settings in runs]


def metrics(run: Path) -> list[dict]:
    return pq.read_table(run / "metrics.parquet").to_pylist()


@pytest.mark.slow
def test_fsdp_at_two_ranks_is_bitwise_data_parallel_at_one(tmp_path):
    """lag 0 (live weights, the generator synced in the trainer's thread) and lag 1 (shard
    snapshots on the rollout group, the same-weights scorer), with the KL reference sharded:
    every audit record and metric of FSDP2 at W = 2 is DP's at W = 1, with zero gap. Control: the
    DP run with another seed differs, so the comparison can fail."""
    fsdp = ['parallel.mode="fsdp"']
    runs = {name: tmp_path / name for name in ("dp0", "dp1", "seed1", "fsdp0", "fsdp1")}
    lag1 = ["rollout.lag=1", "steps=3"]
    one = [(runs["dp0"], []), (runs["dp1"], lag1), (runs["seed1"], ["rollout.lag=1", "seed=1", "steps=1"])]
    gaps = run_ranks(_runs, 1, (one,))[0]
    two = run_ranks(_runs, 2, ([(runs["fsdp0"], fsdp), (runs["fsdp1"], [*fsdp, *lag1])],))
    assert gaps == [0, 0, 0] and two[0] == two[1] == [0, 0]
    for dp, sharded in (("dp0", "fsdp0"), ("dp1", "fsdp1")):
        result = compare_runs(runs[dp], runs[sharded])
        assert result.identical and result.compared > 0, result.first_divergence
        a, b = metrics(runs[dp]), metrics(runs[sharded])
        named = ("loss", "grad_norm", "reward_mean", "gap_tokens", "ratio_max")
        assert [[r[k] for k in named] for r in a] == [[r[k] for k in named] for r in b]
        assert {r["world_size"] for r in b} == {2}
        assert any(r["grad_norm"] > 0 for r in a) and len({r["reward_mean"] for r in a}) > 1  # a real update
    control = compare_runs(runs["dp1"], runs["seed1"])
    assert not control.identical and control.first_divergence is not None
    rollout_ranks = {r["rank"] for r in pq.read_table(runs["fsdp1"] / "audit").to_pylist() if r["phase"] == "rollout"}
    assert rollout_ranks == {0, 1}  # both ranks generated their interleaved prompts


class _Recorder:
    """Catches what the loop builds: its generator and the trainer's model, and every job."""

    def __init__(self, monkeypatch) -> None:
        self.generators, self.models, self.jobs, self.workers = [], [], [], []
        build = rl_loop.build_generator

        def build_generator(kind, model, bi, slots, *, share=False):
            self.models.append(model)
            self.generators.append(build(kind, model, bi, slots, share=share))
            return self.generators[-1]

        submit = RolloutWorker.submit

        def record_submit(worker, job):
            self.workers.append(worker)
            self.jobs.append(job)
            return submit(worker, job)

        monkeypatch.setattr(rl_loop, "build_generator", build_generator)
        monkeypatch.setattr(RolloutWorker, "submit", record_submit)

    def storages(self, job) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in job.weights.values()}


def test_lag_zero_generates_with_the_trainers_tensors_and_lag_one_keeps_one_snapshot_per_version(tmp_path, monkeypatch):
    """Lag 0: the generator's module is the trainer's (its parameters' data_ptr are the trainer's)
    and every job carries the trainer's own tensors: no snapshot, no generator copy, zero gap.
    Lag 1 (control of the same checks): the generator has its own memory, each policy version is
    one snapshot (the two jobs of version 0 share it), none of them the trainer's, and the
    same-weights scorer computes on the generator's model, not a third copy."""
    caught = _Recorder(monkeypatch)
    result = rl_train(_config(steps=2), tmp_path / "lag0", quiet=True)
    assert result.max_gap_differing == 0 and any(r["grad_norm"] > 0 for r in metrics(tmp_path / "lag0"))
    (gen,), (model,) = caught.generators, caught.models
    assert gen.model is model and gen.shared
    trainer = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in gen.model.parameters()} == trainer
    assert [j.step for j in caught.jobs] == [1, 2]
    state = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert all(caught.storages(j) == state for j in caught.jobs)  # the trainer's tensors, never a clone

    caught = _Recorder(monkeypatch)
    result = rl_train(_config("rollout.lag=1", steps=3), tmp_path / "lag1", quiet=True)
    assert result.max_gap_differing == 0
    (gen,), (model,) = caught.generators, caught.models
    assert not gen.shared and gen.model is not model
    trainer = {p.data_ptr() for p in model.parameters()}
    assert not {p.data_ptr() for p in gen.model.parameters()} & trainer
    assert [(j.step, j.version) for j in caught.jobs] == [(1, 0), (2, 0), (3, 1), (4, 2)]
    snapshots = [caught.storages(j) for j in caught.jobs]
    assert snapshots[0] == snapshots[1]  # one snapshot per version: the two jobs of version 0 share it
    assert not snapshots[1] & snapshots[2] and not snapshots[2] & snapshots[3] and not snapshots[1] & snapshots[3]
    assert not any(s & trainer for s in snapshots)
    assert caught.workers[0].scorer.model is gen.model and not caught.workers[0].scorer.own


def _fingerprints(rank: int, world_size: int) -> dict:
    """Rank entry: a tiny-dense state sharded dim 0 over the ranks (plus an uneven 5-row tensor),
    fingerprinted from the shards, below and above the whole-hash limit; a generator loaded from
    the shards; then one element of one shard on the last rank changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_audit.audit import fingerprint
    from titan_audit.audit.fingerprint import whole_hash_limit
    from titan_audit.models import build
    from titan_audit.rl.builtin import BuiltinGenerator
    from titan_audit.rl.weights import shard_fingerprints

    full = build("tiny-dense", seed=3).state_dict()
    extra = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    out = {"full": {n: fingerprint(t) for n, t in full.items()}, "shards": shard_fingerprints(sharded)}
    uneven = {"uneven": distribute_tensor(extra, mesh, [Shard(0)])}
    with whole_hash_limit(16):  # every tensor on the lattice path: 16 bytes per tensor and rank travel
        out["full_lattice"] = {n: fingerprint(t) for n, t in {**full, "uneven": extra}.items()}
        out["shards_lattice"] = shard_fingerprints({**sharded, **uneven})
    generator = BuiltinGenerator(build("tiny-dense", seed=4))
    generator.load_weights(sharded, 7)  # parameter by parameter from the shards
    out["generator"] = generator.weights_fingerprint()
    name = "layers.1.mlp.down_proj.weight"
    if rank == world_size - 1:
        local = sharded[name].to_local()
        local.view(-1)[-1] = torch.nextafter(local.view(-1)[-1], torch.tensor(float("inf")))
    out["changed"] = shard_fingerprints(sharded)
    with whole_hash_limit(16):
        out["changed_lattice"] = shard_fingerprints(sharded)
    return out


def test_fingerprints_from_shards_are_those_of_the_full_tensors():
    """Layout-invariant by construction: the trainer's per-shard fingerprints equal the full
    tensors' (xxh3 path and lattice path, an uneven dim-0 split included), and a generator loaded
    from the shards reports the same strings. Control: one element one ulp up in one rank's shard
    changes that tensor's fingerprint, and only its, on both paths."""
    results = run_ranks(_fingerprints, 2)
    for r in results:
        assert r["shards"] == r["full"] and r["shards_lattice"] == r["full_lattice"]
        assert r["generator"] == r["full"]
        assert first_difference(r["full"], r["changed"]) == "layers.1.mlp.down_proj.weight"
        assert [n for n in r["full"] if r["full"][n] != r["changed"][n]] == ["layers.1.mlp.down_proj.weight"]
        lattice = {n: v for n, v in r["full_lattice"].items() if n != "uneven"}
        assert [n for n in lattice if lattice[n] != r["changed_lattice"][n]] == ["layers.1.mlp.down_proj.weight"]
    assert results[0] == results[1]  # every rank receives the same strings
