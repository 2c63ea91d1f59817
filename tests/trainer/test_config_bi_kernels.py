"""`determinism.bi_kernels` (the gemm order of BI mode) in the train and RL configs.

Default "v2"; anything but "v1" / "v2" is a ValueError naming the key (CLI exit 2). A saved config
without the key (a run or golden recorded before the key existed) reads as "v1": a resume of it
runs v1 (or is refused when the new config asks for v2), and a golden check names the key.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from titan_audit.audit.config_diff import config_changes
from titan_audit.cli.main import cli
from titan_audit.rl.config import RLConfig, load_rl_config
from titan_audit.rl.config import resume_differences as rl_resume_differences
from titan_audit.rl.config import to_dict as rl_to_dict
from titan_audit.trainer import typed_config
from titan_audit.trainer.config import TrainConfig, load_config, resume_differences, to_dict


def _without_key(saved: dict) -> dict:
    old = typed_config.merge(saved, {})
    del old["determinism"]["bi_kernels"]
    return old


def test_default_is_v2_in_both_configs_and_v1_is_selectable():
    assert load_config("tiny-dense").determinism.bi_kernels == "v2"
    assert load_rl_config("rl-tiny").determinism.bi_kernels == "v2"
    assert load_config("tiny-dense", ["determinism.bi_kernels='v1'"]).determinism.bi_kernels == "v1"
    assert load_rl_config("rl-tiny", ["determinism.bi_kernels=v1"]).determinism.bi_kernels == "v1"


@pytest.mark.parametrize("load, source", [(load_config, "tiny-dense"), (load_rl_config, "rl-tiny")])
@pytest.mark.parametrize("value", ["v3", "1", "true"])
def test_a_bad_value_names_the_key(load, source, value):
    with pytest.raises(ValueError, match=r"determinism\.bi_kernels: .* is not one of 'v1', 'v2'"):
        load(source, [f"determinism.bi_kernels={value}"])


@pytest.mark.parametrize("command, source", [("train", "tiny-dense"), ("rl", "rl-tiny")])
def test_a_bad_value_exits_2_naming_the_key(tmp_path, command, source):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli, [command, "--config", source, "--out", str(out), "--set", "determinism.bi_kernels=v3"]
    )
    assert result.exit_code == 2, result.output
    assert "determinism.bi_kernels: 'v3' is not one of 'v1', 'v2'" in result.output
    assert not out.exists()  # refused before any work


@pytest.mark.parametrize(
    "cls, saved",
    [
        (TrainConfig, lambda: to_dict(load_config("tiny-dense"))),
        (RLConfig, lambda: rl_to_dict(load_rl_config("rl-tiny"))),
    ],
)
def test_a_saved_config_without_the_key_reads_as_v1(cls, saved):
    old = _without_key(saved())
    assert typed_config.fill_added_keys(cls, old)["determinism"]["bi_kernels"] == "v1"
    assert "bi_kernels" not in old["determinism"]  # a copy: the saved dict is left alone
    assert typed_config.build(cls, typed_config.fill_added_keys(cls, old)).determinism.bi_kernels == "v1"
    # negative control: a saved config that names the order keeps it
    assert typed_config.fill_added_keys(cls, saved())["determinism"]["bi_kernels"] == "v2"


def test_a_resume_of_an_old_run_stays_v1():
    old = _without_key(to_dict(load_config("tiny-dense", ["determinism.batch_invariant=true"])))
    v1 = load_config("tiny-dense", ["determinism.batch_invariant=true", "determinism.bi_kernels=v1"])
    v2 = load_config("tiny-dense", ["determinism.batch_invariant=true"])
    assert resume_differences(old, v1) == []
    assert resume_differences(old, v2) == ["determinism.bi_kernels: 'v1' -> 'v2'"]
    rl_old = _without_key(rl_to_dict(load_rl_config("rl-tiny")))
    assert rl_resume_differences(rl_old, load_rl_config("rl-tiny", ["determinism.bi_kernels=v1"])) == []
    assert rl_resume_differences(rl_old, load_rl_config("rl-tiny")) == ["determinism.bi_kernels: 'v1' -> 'v2'"]


def test_config_changes_read_a_missing_key_as_v1():
    new = to_dict(load_config("tiny-dense"))
    old = _without_key(new)
    assert config_changes(old, new) == [("determinism.bi_kernels", "v1", "v2")]
    v1 = to_dict(load_config("tiny-dense", ["determinism.bi_kernels=v1"]))
    assert config_changes(old, v1) == []


def test_a_resume_without_config_runs_an_old_run_in_v1(tmp_path):
    """`--resume` without --config takes the run's saved config: an old one (no key) resumes in v1."""
    import json

    from titan_audit.trainer.resolve import resolve_config
    from titan_audit.trainer.run_dir import MANIFEST
    from titan_audit.trainer.train import TRAIN_JOB

    old = _without_key(to_dict(load_config("tiny-dense", ["determinism.batch_invariant=true"])))
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "train", "config": old}))
    config = resolve_config(TRAIN_JOB, None, tmp_path, resume=True, overrides=["steps=9"])
    assert config.determinism.bi_kernels == "v1" and config.steps == 9
    new = to_dict(load_config("tiny-dense"))  # negative control: a new run's saved config keeps v2
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "train", "config": new}))
    config = resolve_config(TRAIN_JOB, None, tmp_path, resume=True, overrides=[])
    assert config.determinism.bi_kernels == "v2"
