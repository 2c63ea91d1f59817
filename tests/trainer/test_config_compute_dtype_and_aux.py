"""The config keys model.compute_dtype and model.router_aux_loss_coef: defaults, errors that name
the key, and the resume rule (neither is resume-mutable; a run saved before they existed resumes
as their defaults)."""

import pytest

from titan_audit.trainer.config import RESUME_MUTABLE_KEYS, load_config, resume_differences, to_dict


def test_defaults_and_the_tiny_moe_recipe():
    dense, moe = load_config("tiny-dense"), load_config("tiny-moe")
    assert (dense.model.compute_dtype, dense.model.router_aux_loss_coef) == ("float32", 0.0)
    assert (moe.model.compute_dtype, moe.model.router_aux_loss_coef) == ("float32", 0.01)
    bf16 = load_config("tiny-dense", ["model.compute_dtype=bfloat16"])
    assert str(bf16.model.torch_compute_dtype) == "torch.bfloat16"


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        (
            "tiny-dense",
            ["model.compute_dtype=float16"],
            "model.compute_dtype: 'float16' is not one of 'float32', 'bfloat16'",
        ),
        ("tiny-dense", ["model.compute_dtype=1"], "model.compute_dtype"),
        ("tiny-dense", ["model.compute_dtypes=bfloat16"], "unknown key 'model.compute_dtypes'"),
        ("tiny-moe", ["model.router_aux_loss_coef=-0.1"], "model.router_aux_loss_coef must be a finite number >= 0"),
        (
            "tiny-moe",
            ["model.router_aux_loss_coef=inf"],
            "model.router_aux_loss_coef: expected a finite number, got inf",
        ),
        ("tiny-moe", ["model.router_aux_loss_coef=true"], "model.router_aux_loss_coef: expected"),
        ("tiny-dense", ["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef = 0.01 needs an MoE model"),
    ],
)
def test_bad_values_name_the_key(recipe, overrides, message):
    with pytest.raises(ValueError) as error:
        load_config(recipe, overrides)
    assert message in str(error.value)


def test_resume_refuses_changes_and_reads_missing_keys_as_defaults():
    assert not {"model.compute_dtype", "model.router_aux_loss_coef"} & RESUME_MUTABLE_KEYS
    saved = to_dict(load_config("tiny-moe"))
    assert resume_differences(saved, load_config("tiny-moe", ["model.compute_dtype=bfloat16"])) == [
        "model.compute_dtype: 'float32' -> 'bfloat16'"
    ]
    assert resume_differences(saved, load_config("tiny-moe", ["model.router_aux_loss_coef=0"])) == [
        "model.router_aux_loss_coef: 0.01 -> 0.0"
    ]
    # a run saved before the keys existed: float32 compute and no aux loss
    old = to_dict(load_config("tiny-moe", ["model.router_aux_loss_coef=0"]))
    del old["model"]["compute_dtype"], old["model"]["router_aux_loss_coef"]
    assert resume_differences(old, load_config("tiny-moe", ["model.router_aux_loss_coef=0"])) == []
    assert resume_differences(old, load_config("tiny-moe")) == ["model.router_aux_loss_coef: 0.0 -> 0.01"]
