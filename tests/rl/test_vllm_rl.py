"""`titan-audit verify-onpolicy --generator vllm`: 20 RL steps with rollouts from our model inside
vLLM, zero gap at every step, and the same run (every audit hash: rollout tokens, generator and
trainer log-probs, losses, gradients, parameters) as with the built-in generator."""

from __future__ import annotations

import glob
import json

import pyarrow.parquet as pq
import pytest
from vllm_common import cli, cli_here, needs_vllm, one_line_error

pytestmark = [*needs_vllm, pytest.mark.slow]
SMALL = [
    "--set",
    "task.prompts_per_step=2",
    "--set",
    "task.samples_per_prompt=2",
    "--set",
    "sampling.max_new_tokens=6",
    "--set",
    "parallel.threads=1",
    "--set",
    "model.overrides.num_hidden_layers=2",
    "--set",
    "checkpoint.interval=0",
]


def audit_hashes(run) -> dict[tuple, str]:
    rows = {}
    for part in sorted(glob.glob(f"{run}/audit/*.parquet")):
        for r in pq.read_table(part).to_pylist():
            rows[(r["step"], r["phase"], r["microbatch"], r["name"])] = r["hash"]
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-rl")
    out = {}
    for generator in ("builtin", "vllm"):
        proc = cli(
            "verify-onpolicy",
            "--config",
            "rl-tiny",
            "--steps",
            "20",
            "--out",
            str(base / generator),
            "--generator",
            generator,
            "--json",
            *SMALL,
            "--set",
            "determinism.census=strict",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[generator] = (base / generator, json.loads(proc.stdout))
    return out


def test_twenty_steps_zero_gap_with_vllm(runs):
    run, verdict = runs["vllm"]
    assert verdict["zero_gap"] is True and verdict["steps"] == 20 and verdict["steps_with_gap"] == 0
    assert verdict["tokens_compared"] > 20 * 4 and verdict["tokens_differing"] == 0
    metrics = pq.read_table(f"{run}/metrics.parquet").to_pylist()
    assert [m["gap_tokens_differing"] for m in metrics] == [0] * 20
    assert json.loads((run / "manifest.json").read_text())["config"]["generator"] == "vllm"


@pytest.mark.parametrize("generator", ["builtin", "vllm"])
def test_strict_census_saw_no_native_op(runs, generator):
    """Both runs ran under the strict op census (determinism.census=strict: a native op would have
    stopped them): trainer, rollout thread, in-process vLLM engine, log-prob recompute, AdamW."""
    census = json.loads((runs[generator][0] / "manifest.json").read_text())["bi_census"]
    assert census == {"mode": "strict", "native_ops_seen": {}}


def test_vllm_and_builtin_runs_are_the_same_run(runs):
    builtin, vllm = audit_hashes(runs["builtin"][0]), audit_hashes(runs["vllm"][0])
    assert len(builtin) > 20 * 10 and builtin.keys() == vllm.keys()
    assert {k for k in builtin if builtin[k] != vllm[k]} == set()
    assert any(k[1] == "rollout" and k[3] == "generator_logprobs" for k in builtin)


def test_vllm_generator_refuses_several_ranks(tmp_path):
    proc = cli_here("rl", "--config", "rl-tiny", "--out", str(tmp_path / "r"), "--generator", "vllm", "--nproc", "2")
    one_line_error(proc, r"generator = 'vllm' runs on one rank")
    assert not (tmp_path / "r").exists()
