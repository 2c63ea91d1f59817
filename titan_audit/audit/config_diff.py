"""The differences between two runs' configs (the `config` of their manifests), key by key.

    config_changes(manifest_a["config"], manifest_b["config"])  # [("seed", 0, 1), ...]

Guarantees:
- Nested sections are flattened to dotted keys (`schedule.decay_steps`); a key one config lacks
  counts as a difference (its value None). Keys are listed in sorted order, so the output is stable.
- A key one config lacks and the other holds at its entry in `ADDED_KEY_DEFAULTS` (a key added
  after runs were recorded, at the default that keeps the old behaviour) is no difference: an old
  golden or run compares with a new config that leaves the key alone. Its value there can differ
  from the key's default for new configs (`determinism.bi_kernels`: "v1" for an old run, "v2" new),
  so an old golden checked by a new default run names that key as a difference.
- By default the keys in `CONFIG_KEYS_IGNORED` are left out: they never change the bits of a step
  (how long a run goes, how often it saves or flushes, how it launches, where its metrics go). A
  prefix ending in "." leaves out a whole section. `golden check` and `compare` report
  differences through this one function.
- `model_changes` is the same for the `model` section alone (what `golden update` refuses to change
  silently).
"""

from __future__ import annotations

from typing import Any

# Config keys that never change the bits of a step (how long, how often it saves or flushes, how
# it launches). Differences elsewhere are reported.
CONFIG_KEYS_IGNORED: tuple[str, ...] = (
    "steps",
    "checkpoint.",
    "audit.flush_every_steps",
    "parallel.backend",
    "parallel.tp",  # a layout, like the world size (never the bits in BI mode: tests/trainer/test_tensor_parallel.py)
    "data.workers",
    "determinism.census",  # record | strict | off: never the bits of a step
    "logging.",  # metrics.jsonl, TensorBoard: where the metrics go, never their bits
)

# Keys added after runs (and goldens) were recorded, with the default that behaves as before they
# existed; keys whose default is None need no entry (a missing key already reads as None).
ADDED_KEY_DEFAULTS: dict[str, Any] = {
    "task.prompt_column": "prompt",  # rl: the user's prompts file (issue 24)
    "task.shuffle": True,
    "task.reward_check": True,
    "tokenizer.chat_template": False,
    # the gemm order (batch_invariant/order.py): runs before it existed summed in order v1; its
    # default for new configs is v2
    "determinism.bi_kernels": "v1",
    "determinism.grad_norm": "v1",  # the clip norm's order (trainer/grad_norm.py): v1 before v2 existed
    "parallel.device": "cpu",  # every run before the key existed ran on the CPU (issue 27)
    "parallel.mode": "dp",  # rl: every run before the key existed ran data parallel
}


def flatten_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; an empty section stays a key of its own ({} value)."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _ignored(key: str, ignored: tuple[str, ...]) -> bool:
    return any(key == i or (i.endswith(".") and key.startswith(i)) for i in ignored)


def config_changes(
    config_a: Any, config_b: Any, *, ignored: tuple[str, ...] = CONFIG_KEYS_IGNORED
) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every key whose values differ, sorted by key."""
    a, b = flatten_config(config_a or {}), flatten_config(config_b or {})
    for key, default in ADDED_KEY_DEFAULTS.items():
        if (key in a) != (key in b):
            (b if key in a else a).setdefault(key, default)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if not _ignored(k, ignored) and a.get(k) != b.get(k)
    ]


def model_changes(config_a: Any, config_b: Any) -> list[tuple[str, Any, Any]]:
    """`config_changes` of the `model` sections alone (keys as `model.preset`, ...)."""
    a = (config_a or {}).get("model") if isinstance(config_a, dict) else None
    b = (config_b or {}).get("model") if isinstance(config_b, dict) else None
    return config_changes({"model": a or {}}, {"model": b or {}}, ignored=())


def change_text(change: tuple[str, Any, Any]) -> str:
    """'seed: 0 -> 1' (values as repr, so a string and a number of the same digits differ)."""
    key, a, b = change
    return f"{key}: {a!r} -> {b!r}"
