"""Small runs for the report tests, made once per session (test_report.py and the browser test
share them): a 4-step tiny-dense run with a checkpoint at step 2, its elastic replay from step 2,
the same run with seed 1 (for --against), and a 2-step verified RL run from the first run."""

from __future__ import annotations

from pathlib import Path

import pytest


def _train(out: Path, overrides: list[str]) -> Path:
    from titan_audit.trainer.config import load_config
    from titan_audit.trainer.launch import LaunchOptions, launch
    from titan_audit.trainer.train import TRAIN_JOB

    config = load_config("tiny-dense", ["steps=4", "checkpoint.interval=2", "data.synthetic_records=256", *overrides])
    assert launch(TRAIN_JOB, config, out, nproc=None, options=LaunchOptions(quiet=True)) == 0
    return out


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    from titan_audit.rl.loop import RL_JOB
    from titan_audit.trainer.launch import LaunchOptions, start
    from titan_audit.trainer.replay import elastic_replay

    root = tmp_path_factory.mktemp("report-runs")
    base = _train(root / "base", [])
    seed1 = _train(root / "seed1", ["seed=1"])
    replay, _ = elastic_replay(base, 2, root / "base-replay", nproc=1, quiet=True)
    assert replay.identical
    rl = root / "rl"
    rc = start(
        RL_JOB,
        "rl-tiny",
        rl,
        nproc=None,
        steps=2,
        options=LaunchOptions(init=str(base), quiet=True),
        overrides=[
            "verify=true",
            "task.prompts_per_step=2",
            "task.samples_per_prompt=2",
            "sampling.max_new_tokens=4",
            "checkpoint.interval=0",
        ],
    )
    assert rc == 0
    return {"base": base, "seed1": seed1, "replay": root / "base-replay", "rl": rl}
