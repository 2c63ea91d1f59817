"""Typed configs: exact builds, errors that name the key, TOML values in --set overrides."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from titan_audit.trainer.typed_config import apply_overrides, build, load_toml, merge, parse_override, to_dict


@dataclass
class Inner:
    lr: float = 1e-3
    betas: tuple[float, ...] = (0.9, 0.95)
    name: str | None = None


@dataclass
class Outer:
    seed: int = 0
    mode: Literal["dp", "fsdp"] = "dp"
    inner: Inner = field(default_factory=Inner)
    flag: bool = False


def test_builds_nested_dataclasses_and_round_trips():
    cfg = build(Outer, {"seed": 3, "mode": "fsdp", "inner": {"lr": 2, "betas": [0.8, 0.9]}})
    assert cfg == Outer(seed=3, mode="fsdp", inner=Inner(lr=2.0, betas=(0.8, 0.9)))
    assert build(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"sed": 1}, "unknown key 'sed'"),
        ({"inner": {"lrr": 1}}, "unknown key 'inner.lrr'"),
        ({"seed": "1"}, "seed: expected int, got str"),
        ({"seed": True}, "seed: expected int, got bool"),
        ({"flag": 1}, "flag: expected bool"),
        ({"inner": {"lr": "fast"}}, "inner.lr: expected a number"),
        ({"mode": "tp"}, "mode: 'tp' is not one of 'dp', 'fsdp'"),
        ({"inner": {"betas": 0.9}}, "inner.betas: expected a list"),
        ({"inner": {"betas": [0.9, "x"]}}, r"inner.betas\[1\]: expected a number"),
        ({"inner": 3}, "inner: expected a table"),
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        build(Outer, data)


def test_overrides_parse_toml_values_and_fall_back_to_strings():
    assert parse_override("inner.lr=3e-4") == (["inner", "lr"], 3e-4)
    assert parse_override("flag=true") == (["flag"], True)
    assert parse_override("mode=fsdp") == (["mode"], "fsdp")
    assert parse_override("inner.betas=[0.5, 0.6]") == (["inner", "betas"], [0.5, 0.6])
    data = apply_overrides({"seed": 1}, ["inner.lr=0.5", "seed=2"])
    assert build(Outer, data) == Outer(seed=2, inner=Inner(lr=0.5))
    with pytest.raises(ValueError, match="expected section.key=value"):
        parse_override("seed")
    with pytest.raises(ValueError, match="'seed' is not a table"):
        apply_overrides({"seed": 1}, ["seed.x=1"])


def test_merge_is_recursive_and_does_not_mutate():
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    out = merge(base, {"a": {"b": 5}})
    assert out == {"a": {"b": 5, "c": 2}, "d": 3} and base["a"]["b"] == 1


def test_toml_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.toml: no such config file"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = = 1")
    with pytest.raises(ValueError, match="bad.toml: invalid TOML"):
        load_toml(bad)
    good = tmp_path / "good.toml"
    good.write_text("seed = 4\n[inner]\nlr = 0.1\n")
    assert build(Outer, load_toml(good)) == Outer(seed=4, inner=Inner(lr=0.1))
