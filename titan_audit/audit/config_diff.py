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
- `expected_differences` names, before any record is compared, why two runs whose fingerprints
  match may still differ bitwise: a tensor-parallel layout (`parallel.tp`, an ignored key because
  in BI mode it never changes the bits) outside batch-invariant mode, where TP runs native kernels
  and a plain all_reduce of the partial sums. Empty when both runs are in BI mode or share one TP
  degree; `compare` prints it as a warning and `golden check` as a note, above the verdict.
  `run_expected_differences` adds the runs' `digest_differences` (run_manifest.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_audit.audit.run_manifest import MANIFEST, digest_differences, read_manifest

# Config keys that never change the bits of a step (how long, how often it saves or flushes, how
# it launches). Differences elsewhere are reported.
CONFIG_KEYS_IGNORED: tuple[str, ...] = (
    "steps",
    "checkpoint.",
    "audit.flush_every_steps",
    "audit.stats",  # which records carry absmax / mean (never compared)
    "parallel.backend",
    "parallel.tp",  # a layout, like the world size (never the bits in BI mode: tests/trainer/test_tensor_parallel.py)
    "data.workers",
    "determinism.census",  # record | strict | off: never the bits of a step
    "logging.",  # metrics.jsonl, TensorBoard: where the metrics go, never their bits
)

# Keys added after runs (and goldens) were recorded, with the default that behaves as before they
# existed; keys whose default is None need no entry (a missing key already reads as None).
ADDED_KEY_DEFAULTS: dict[str, Any] = {
    "task.prompt_column": "prompt",  # rl: the user's prompts file
    "task.shuffle": True,
    "task.reward_check": True,
    "tokenizer.chat_template": False,
    # the gemm order (batch_invariant/order.py): runs before it existed summed in order v1; its
    # default for new configs is v2
    "determinism.bi_kernels": "v1",
    "determinism.grad_norm": "v1",  # the clip norm's order (trainer/grad_norm.py): v1 before v2 existed
    "parallel.device": "cpu",  # every run before the key existed ran on the CPU
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


def expected_differences(config_a: Any, config_b: Any, *, names: tuple[str, str] = ("A", "B")) -> list[str]:
    """Why bitwise equality of two runs is not expected from their configs alone ([] when it is);
    `names` label the two sides in the text ("golden", "run" for a golden check)."""
    a, b = flatten_config(config_a or {}), flatten_config(config_b or {})
    tp_a, tp_b = a.get("parallel.tp", 1), b.get("parallel.tp", 1)
    native = [side for side, c in zip(names, (a, b)) if not c.get("determinism.batch_invariant", False)]
    if tp_a == tp_b or not native:
        return []
    return [
        f"the tensor-parallel layout differs (parallel.tp: {tp_a!r} -> {tp_b!r}) and batch-invariant mode is off "
        f"in {' and '.join(native)} (determinism.batch_invariant = false): outside BI mode a TP layout runs native "
        "kernels and a plain all_reduce of the partial sums, so its bits need not be TP=1's; TP invariance is a "
        "BI-mode property (--set determinism.batch_invariant=true on both runs)"
    ]


def run_expected_differences(
    run_a: str | os.PathLike, run_b: str | os.PathLike, *, differed: bool = False
) -> list[str]:
    """`expected_differences` of two run directories' manifest configs, then their
    `digest_differences` (run_manifest.py; `differed`: the records were found to differ)."""
    manifests = []
    for run in (Path(run_a), Path(run_b)):
        manifests.append(read_manifest(run) if (run / MANIFEST).is_file() else {})
    configs = [m.get("config") for m in manifests]
    out = expected_differences(*configs) if all(isinstance(c, dict) for c in configs) else []
    return out + digest_differences(*manifests, differed=differed)


def change_text(change: tuple[str, Any, Any]) -> str:
    """'seed: 0 -> 1' (values as repr, so a string and a number of the same digits differ)."""
    key, a, b = change
    return f"{key}: {a!r} -> {b!r}"
