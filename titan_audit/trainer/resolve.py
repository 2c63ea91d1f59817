"""The config of a launch, resolved once for every job (train, RL): `resolve_config`.

Guarantees: the config builds exactly from its source (a recipe name or a TOML file) with the
`--set` overrides, or fails with a ValueError naming the key and the file; on a resume without a
source it is the run's saved config (keys added since filled with their defaults) with the
overrides applied. With an init (`--init`, or a resume of a run that started from one) the model
section takes the init's shape and a model key the user set that contradicts it is refused
(trainer/init.py). Nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_audit.trainer import typed_config
from titan_audit.trainer.checks import saved_manifest
from titan_audit.trainer.init import explicit_model, init_kind, model_with_shape, run_model_config, saved_init


def resolve_config(
    job: Any,
    source: str | None,
    out: str | os.PathLike,
    *,
    resume: bool,
    overrides: Sequence[str] = (),
    init: str | os.PathLike | None = None,
) -> Any:
    """The `job`'s config (a trainer/launch JobSpec: its config class, recipes and kind) for a
    launch into `out` (see the module docstring). On a resume without --init, the run's own model
    section is the shape (its init may be gone: the checkpoints hold the weights)."""
    overrides = list(overrides)
    if source is None:
        if not resume:
            names = ", ".join(sorted(job.recipes))
            raise ValueError(
                f"--config is required (one of the {job.recipe_word}s {names}, or a TOML file) unless --resume"
            )
        saved = typed_config.fill_added_keys(job.config_class, saved_manifest(Path(out), job.kind)["config"])
        where = f"{out}/manifest.json config"
        return typed_config.build(job.config_class, typed_config.apply_overrides(saved, overrides), where)
    shape, label = None, None
    saved_source = saved_init(out) if init is None and resume else None
    if init is not None:
        _, shape = init_kind(init)
        label = f"--init {init}"
    elif saved_source is not None:
        shape = run_model_config(Path(out), f"{out}/manifest.json")
        label = f"the init of {out} ({saved_source})"
    if shape is None:
        return typed_config.load(job.config_class, source, job.recipes, overrides, job.recipe_word)
    data, origin = typed_config.load_source(source, job.recipes, overrides, job.recipe_word)
    model = data.get("model", {})
    if isinstance(model, dict):
        data["model"] = model_with_shape(model, explicit_model(source, job.recipes, overrides), shape, label)
    try:
        return typed_config.build(job.config_class, data)
    except ValueError as error:
        raise ValueError(f"{origin}: {error}") from None
