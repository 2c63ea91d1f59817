"""`titan-audit train --init`: from a transformers-saved Qwen3 of another shape than the recipe's
preset, and from another run's latest checkpoint. The run takes the init's shape (recorded in its
resolved model section) and its weights bitwise (the manifest's digest); a model key the user set
that contradicts the init, and a resume with another init, are one-line errors with nothing
written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trainer._init_runs import QUICK, VOCAB, cli, ok, one_line_error, save_hf_qwen3

pytest.importorskip("transformers")


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_qwen3(tmp_path_factory.mktemp("hf") / "qwen3")


@pytest.fixture(scope="module")
def from_hf(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("from-hf") / "run"
    ok(cli("train", "--config", "tiny-dense", "--init", hf_dir, "--out", out, "--steps", "2", *QUICK))
    return out


def test_train_from_an_hf_directory_takes_its_shape_and_its_weights(hf_dir, from_hf):
    from titan_audit.models import build, from_pretrained, load_config
    from titan_audit.trainer.config import ModelSection
    from titan_audit.trainer.init import weights_digest

    shape = load_config(hf_dir)
    model = manifest(from_hf)["config"]["model"]
    assert model["preset"] == "tiny-dense" and model["overrides"]["vocab_size"] == VOCAB
    assert ModelSection(**model).model_config() == shape  # the resolved config records the whole shape
    init = manifest(from_hf)["init"]
    assert init["kind"] == "hf" and init["source"] == str(hf_dir)
    assert init["weights"] == weights_digest(from_pretrained(hf_dir))
    # negative control: the digest tells weights apart (the seed's init of the same shape differs)
    assert init["weights"] != weights_digest(build(shape, seed=0))


def test_train_from_a_run_takes_its_latest_checkpoint(from_hf, tmp_path):
    from titan_audit.models import build
    from titan_audit.trainer.config import ModelSection
    from titan_audit.trainer.init import load_checkpoint, weights_digest

    out = tmp_path / "run"
    ok(cli("train", "--config", "tiny-dense", "--init", from_hf, "--out", out, "--steps", "1", *QUICK))
    assert manifest(out)["config"]["model"] == manifest(from_hf)["config"]["model"]
    init = manifest(out)["init"]
    assert (init["kind"], init["step"]) == ("run", 2)
    latest = build(ModelSection(**manifest(from_hf)["config"]["model"]).model_config())
    load_checkpoint(from_hf, 2, latest, portable=False)
    earlier = build(latest.config)
    load_checkpoint(from_hf, 1, earlier, portable=False)
    assert init["weights"] == weights_digest(latest) != weights_digest(earlier)  # the latest, not another


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (
            ["--set", "model.overrides.vocab_size=2048"],
            rf"model\.overrides\.vocab_size = 2048 contradicts --init .*: its model has vocab_size = {VOCAB}",
        ),
        (
            ["--set", 'model.preset="llama-tiny"'],
            r"model\.preset = 'llama-tiny' contradicts --init .*: the preset has vocab_size = 2048, the init vocab_",
        ),
    ],
    ids=["override", "preset"],
)
def test_a_model_key_contradicting_the_init_is_refused_naming_it(hf_dir, tmp_path, extra, pattern):
    out = tmp_path / "run"
    one_line_error(cli("train", "--config", "tiny-dense", "--init", hf_dir, "--out", out, *extra), pattern)
    assert not out.exists()


def test_a_toml_model_key_is_explicit_and_an_agreeing_one_is_taken(hf_dir, tmp_path):
    from titan_audit.models import load_config
    from titan_audit.trainer.resolve import resolve_config
    from titan_audit.trainer.train import TRAIN_JOB

    toml = tmp_path / "r.toml"
    toml.write_text('recipe = "tiny-dense"\n[model.overrides]\nnum_hidden_layers = 4\n')
    out = tmp_path / "run"
    one_line_error(
        cli("train", "--config", toml, "--init", hf_dir, "--out", out),
        r"model\.overrides\.num_hidden_layers = 4 contradicts --init .*num_hidden_layers = 2",
    )
    assert not out.exists()
    agreeing = ["model.overrides.vocab_size=512", 'model.compute_dtype="bfloat16"']
    config = resolve_config(TRAIN_JOB, "tiny-dense", out, resume=False, overrides=agreeing, init=hf_dir)
    assert config.model.model_config() == load_config(hf_dir) and config.model.compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown key 'model\.overrides\.nope'"):  # not dropped by the shape
        resolve_config(TRAIN_JOB, "tiny-dense", out, resume=False, overrides=["model.overrides.nope=1"], init=hf_dir)


def test_a_resume_keeps_its_init_and_refuses_another(hf_dir, from_hf, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(from_hf, run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    one_line_error(
        cli("train", "--out", run, "--resume", "--steps", "3", "--init", from_hf),
        r"--init .* differs from the run's \(.*qwen3\)",
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    # the recipe again, with the same init or none: the init's shape, so the resume is allowed
    ok(cli("train", "--config", "tiny-dense", "--out", run, "--resume", "--steps", "3", *QUICK))
    ok(cli("train", "--config", "tiny-dense", "--init", hf_dir, "--out", run, "--resume", "--steps", "4", *QUICK))
    assert manifest(run)["init"] == manifest(from_hf)["init"]
    assert [h["start_step"] for h in manifest(run)["world_size_history"]] == [0, 2, 3]


def test_an_init_that_is_neither_is_refused_before_any_write(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    one_line_error(
        cli("train", "--config", "tiny-dense", "--init", tmp_path / "empty", "--out", out),
        r"neither a run directory .* nor an HF model directory",
    )
    assert not out.exists()


def test_two_ranks_from_the_init_follow_the_one_rank_trajectory(hf_dir, from_hf, tmp_path):
    """G3 from an init: every rank loads it (torchrun passes --init on), the same bits as at W=1."""
    from titan_audit.audit import compare_runs

    out = tmp_path / "w2"
    ok(cli("train", "--config", "tiny-dense", "--init", hf_dir, "--out", out, "--steps", "2", *QUICK, "--nproc", "2"))
    result = compare_runs(from_hf, out)
    assert result.identical and result.compared > 0, result.first_divergence
    assert manifest(out)["init"] == manifest(from_hf)["init"]
