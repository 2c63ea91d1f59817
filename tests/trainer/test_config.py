"""TrainConfig: recipes, TOML files, --set overrides, errors that name the key, resume rules."""

import pytest

from titan_audit.trainer.config import RECIPES, from_dict, load_config, resume_differences, to_dict


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_build_round_trip_and_use_v8_with_checkpoints_every_4(recipe):
    config = load_config(recipe)
    assert config.num_microbatches == 8 and config.checkpoint.interval == 4
    assert from_dict(to_dict(config)) == config
    assert config.model.model_config().num_experts == (8 if recipe == "tiny-moe" else 0)


def test_toml_file_with_base_recipe_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'recipe = "tiny-moe"\nseed = 3\n[model.overrides]\nnum_hidden_layers = 2\n[parallel]\nthreads = 2\n'
    )
    config = load_config(str(path), ["optimizer.lr=1e-3", "steps=5"])
    assert (config.seed, config.steps, config.optimizer.lr, config.parallel.threads) == (3, 5, 1e-3, 2)
    assert config.model.model_config().num_hidden_layers == 2 and config.model.preset == "tiny-moe"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer.lrr=1"], "unknown key 'optimizer.lrr'"),
        (["steps=true"], "steps: expected int"),
        (["model.overrides.hidden_sise=8"], "unknown key 'model.overrides.hidden_sise'"),
        (["model.overrides.num_key_value_heads=3"], "model.overrides:"),
        (["model.preset=nope"], "unknown model preset 'nope'"),
        (["data.global_batch_size=12", "data.microbatch_size=5"], "must be a multiple of data.microbatch_size"),
        (["parallel.threads=0"], "parallel.threads must be >= 1"),
        (["parallel.mode=tp"], "parallel.mode: 'tp' is not one of 'dp', 'fsdp'"),
        (["audit.level=everything"], "audit.level"),
        (['audit.stats=["data", "activations"]'], "audit.stats[1]: 'activations' is not a phase"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=None) as error:
        load_config("tiny-dense", overrides)
    assert message in str(error.value)


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[data]\nseq_len = 'long'\n")
    with pytest.raises(ValueError, match=r"bad.toml: data.seq_len: expected int"):
        load_config(str(path))


def test_world_size_must_divide_v():
    config = load_config("tiny-dense")
    for w in (1, 2, 4, 8):
        config.check_world_size(w)
    with pytest.raises(ValueError, match="world size 3 does not divide .* V = 8"):
        config.check_world_size(3)


def test_resume_may_change_steps_and_checkpointing_but_nothing_that_decides_the_bits():
    saved = to_dict(load_config("tiny-dense"))
    assert (
        resume_differences(saved, load_config("tiny-dense", ["steps=40", "checkpoint.interval=2", "audit.stats=[]"]))
        == []
    )
    assert resume_differences(saved, load_config("tiny-dense", ["parallel.threads=2"])) == ["parallel.threads: 1 -> 2"]
    assert resume_differences(saved, load_config("tiny-dense", ["model.overrides.rope_theta=1.0"])) == [
        "model.overrides: {} -> {'rope_theta': 1.0}"
    ]


def test_audit_stats_chooses_the_phases_with_statistics_and_never_a_hash(tmp_path):
    """`audit.stats` goes to the Recorder: with [] a full-level run's records carry no absmax or
    mean, with the default its forward records do; the hashes are the same (control: the forward
    records' statistics are there in the default run, so the check can see them)."""
    from titan_audit.audit import read_audit_log
    from titan_audit.trainer.train import train

    tiny = [
        "steps=1",
        "audit.level=full",
        "checkpoint.interval=0",
        "data.global_batch_size=2",
        "data.microbatch_size=1",
    ]
    rows = {}
    for name, extra in (("default", []), ("none", ["audit.stats=[]"])):
        train(load_config("tiny-dense", [*tiny, *extra]), tmp_path / name, quiet=True)
        rows[name] = read_audit_log(tmp_path / name).to_pylist()
    assert [r["hash"] for r in rows["none"]] == [r["hash"] for r in rows["default"]]
    assert all(r["absmax"] is None and r["mean"] is None for r in rows["none"])
    assert all(r["absmax"] is not None for r in rows["default"] if r["phase"] == "forward")
