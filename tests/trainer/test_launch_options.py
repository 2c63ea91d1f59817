"""The launch options travel whole and typed: what the launcher writes into the launch file is
what every rank reads back (every field, the audit hand-over included), and a mistyped or
unknown option, or a file of another job, is refused naming it (the negative controls)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_audit.rl.loop import RL_JOB
from titan_audit.trainer.config import load_config
from titan_audit.trainer.launch.spec import LaunchOptions, read_launch_file, write_launch_file
from titan_audit.trainer.train import TRAIN_JOB


def test_every_option_reaches_the_ranks_typed(tmp_path: Path) -> None:
    options = LaunchOptions(
        resume=True,
        overwrite="delete",
        init=tmp_path / "warmup",  # a path is kept as its text
        stop_at=3,
        quiet=True,
        until="reward>=0.24",
        audit_verified={"part-r00000-00000001.parquet": [1234, "ab" * 16, 17]},
    )
    config = load_config("tiny-dense", ["steps=7"])
    path = tmp_path / "launch.json"
    write_launch_file(path, TRAIN_JOB, config, options)
    read_config, read_options = read_launch_file(TRAIN_JOB, path)
    assert read_options == options and read_options.init == str(tmp_path / "warmup")
    assert read_config == config
    assert LaunchOptions.from_dict(LaunchOptions().to_dict()) == LaunchOptions()


def test_a_mistyped_or_unknown_option_and_another_jobs_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "launch.json"
    write_launch_file(path, TRAIN_JOB, load_config("tiny-dense"), LaunchOptions())
    data = json.loads(path.read_text())
    data["options"]["stop_at"] = "3"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"options\.stop_at"):
        read_launch_file(TRAIN_JOB, path)
    data["options"] = {"stop": 3}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"unknown key .*stop"):
        read_launch_file(TRAIN_JOB, path)
    data["options"] = {}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="kind 'train', read by the 'rl' rank entry"):
        read_launch_file(RL_JOB, path)
