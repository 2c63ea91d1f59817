"""Typed dataclass configs from TOML, dicts and `--set section.key=value` overrides.

Guarantee: a config either builds exactly as written or fails before any work with a ValueError
that names the key (as a dotted path) and, for files, the file. Unknown keys, wrong types
(bool is not an int, an int is accepted where a float is expected), a float that is not finite
(nan, inf: TOML and `--set` both accept them), and malformed overrides are all errors; nothing is
silently dropped or coerced. Ranges are each section's own `__post_init__` checks.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such config file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: invalid TOML ({error})") from None


def load_source(
    source: str, recipes: dict[str, dict[str, Any]], overrides: list[str] | tuple[str, ...], what: str = "recipe"
) -> tuple[dict[str, Any], str]:
    """(config data, where it came from) for a recipe name or a TOML file (which may name a base
    recipe with a top-level `recipe = "..."`), with `--set` overrides applied. `what` names the
    kind of recipe in errors ("recipe", "RL recipe")."""
    if source in recipes:
        data, origin = recipes[source], f"{what} {source!r}"
    elif source.endswith(".toml") or Path(source).is_file():
        data, origin = load_toml(source), source
        base = data.pop("recipe", None)
        if base is not None:
            if base not in recipes:
                raise ValueError(f"{source}: {what} {base!r} is not one of {', '.join(sorted(recipes))}")
            data = merge(recipes[base], data)
    else:
        raise ValueError(f"--config {source!r}: neither a known {what} ({', '.join(sorted(recipes))}) nor a TOML file")
    return apply_overrides(data, list(overrides)), origin


def load(
    cls: type[T], source: str, recipes: dict[str, dict[str, Any]], overrides: list[str] | tuple[str, ...], what: str
) -> T:
    """`load_source`, then the config class built from it; errors name the key and the file."""
    data, origin = load_source(source, recipes, overrides, what=what)
    try:
        return build(cls, data)
    except ValueError as error:
        raise ValueError(f"{origin}: {error}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value). The value is read as a TOML value
    (`3`, `1e-3`, `true`, `"x"`, `[1, 2]`); anything that is not valid TOML is taken as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected section.key=value")
    path = [part.strip() for part in key.split(".")]
    if any(not part for part in path):
        raise ValueError(f"--set {text!r}: empty key component")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `data` with each `a.b=value` override set (tables are created as needed)."""
    out = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {text!r}: {part!r} is not a table")
            node = child
        node[path[-1]] = value
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: tables merge key by key, everything else is replaced."""
    out = _deep_copy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = _deep_copy(value)
    return out


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def build(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from `data`, checking every key and type. `where` prefixes key paths."""
    assert dataclasses.is_dataclass(cls), cls
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown key {_join(where, unknown[0])!r}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + f"; known keys here: {', '.join(sorted(fields))}"
        )
    values = {name: _convert(hints[name], data[name], _join(where, name)) for name in data}
    try:
        return cls(**values)
    except TypeError as error:  # a required field without default is missing
        raise ValueError(f"{where or 'config'}: {error}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain TOML/JSON-able data (tuples become lists)."""
    return _plain(dataclasses.asdict(config))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a table, got {type(value).__name__}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):  # nan and inf: no config key means either (and nan != nan breaks resume)
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint in (int, bool, str):
        if type(value) is not hint:
            raise ValueError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"unsupported config type {hint} for {key}")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config data as {dotted key: value}; `model.overrides` stays one value (a free-form table)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "overrides":
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def fill_added_keys(cls: type, saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (a manifest's `config`) with each key `cls` has that was added after the
    config was written set to the value that keeps the old behaviour (`ADDED_KEY_DEFAULTS` of
    audit/config_diff.py, e.g. `determinism.bi_kernels` = "v1": a run recorded before the gemm
    order v2 existed rebuilds as a v1 run). Keys the config holds are left alone; a copy."""
    from titan_audit.audit.config_diff import ADDED_KEY_DEFAULTS

    known = flatten(to_dict(cls()))
    out = _deep_copy(saved)
    for key, value in ADDED_KEY_DEFAULTS.items():
        if key not in known:
            continue
        *sections, name = key.split(".")
        node = out
        for part in sections:  # a missing section is made (it would build at its defaults)
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):  # anything else is left for `build` to refuse, naming the key
            node.setdefault(name, value)
    return out


def resume_differences(saved: dict[str, Any], current: Any, mutable: frozenset[str]) -> list[str]:
    """Dotted keys whose values differ between a run's saved config and `current` (a config
    dataclass), other than the `mutable` keys a resume may change. Empty: the resume is allowed. A
    key the saved config lacks (a run written before the key existed) counts as the value that
    keeps the old behaviour (`fill_added_keys`), else as its default value: new keys default to
    the behaviour that existed before them."""
    a, b = flatten(fill_added_keys(type(current), saved)), flatten(to_dict(current))
    defaults = flatten(to_dict(type(current)()))
    a.update({k: defaults[k] for k in b.keys() - a.keys() if k in defaults and k != "model.overrides"})
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if k not in mutable and a.get(k) != b.get(k)
    ]
