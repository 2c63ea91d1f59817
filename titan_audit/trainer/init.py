"""Where a run's weights start (`train --init`, `rl --init`): another run's latest checkpoint, an
HF model directory, or the deterministic init of (config.model, seed).

    kind, shape = init_kind("hf/qwen3")      # what it is and its model's shape (no tensor read)
    load_init(model, "hf/qwen3")             # its weights, bitwise

Guarantees:
- `init_kind(init)` names the source ('none' | 'run' | 'hf') with its model config, after a
  preflight that reads no tensor (a run: its manifest's model config and the newest checkpoint's
  small files; an HF directory: config.json, the safetensors headers, every tensor's name and
  shape), or raises a ValueError saying what the path is not.
- `model_with_shape` (what trainer/resolve.py applies): with an init, the config's model section
  takes the init's shape whatever the recipe says: the preset is kept and `model.overrides`
  holds every ModelConfig field where the init differs from it, so the resolved config
  (manifest.json) records the shape. A model key the user set (in the TOML file or with --set)
  that contradicts the init is refused: one line naming the key and both values. An explicit
  `model.preset` claims that preset's whole shape. Keys that are no part of a checkpoint
  (activation_checkpointing, router_aux_loss_coef, compute_dtype) stay the config's. All of it
  runs before any file is written.
- `load_init` loads the init's weights bitwise into a materialised model, whole or sharded
  (DTensor parameters: each rank reads only its local pieces, never a second full model): a
  run's checkpoint through DCP, its model tensors verified against its hashes.json (no optimizer
  is built: the optimizer state stays on disk); an HF directory's tensors read slice by slice
  with safetensors' `get_slice`, cast to the parameters' dtype (exact for float32 and bfloat16
  files into float32).
- The manifest's `init` section: {kind, source, step (a run's checkpoint), weights} where
  `weights` is `weights_digest` of the loaded state dict; a resume whose --init names another
  source is refused (`check_resume_init`), and a run that loads its init again (an RL run, or a
  train run resumed before its first checkpoint) refuses weights whose digest changed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from titan_audit.audit.fingerprint import fingerprint, fingerprint_many
from titan_audit.models import ModelConfig, get_preset
from titan_audit.trainer import typed_config
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import ModelSection
from titan_audit.trainer.run_dir import is_run_dir, read_manifest


def model_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    return [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


# ---------------------------------------------------------------------------------- the source
def init_kind(init: str | os.PathLike | None) -> tuple[str, ModelConfig | None]:
    """('none' | 'run' | 'hf', the init's model config); ValueError for anything else."""
    if init is None:
        return "none", None
    path = Path(init)
    if (path / "manifest.json").is_file():
        model = run_model_config(path, f"--init {path}")
        if not Checkpointer(path).steps():
            raise ValueError(f"--init {path}: the run has no checkpoint")
        try:  # the newest checkpoint's small files, as load_init will read them (no fallback)
            Checkpointer(path).preflight(fallback=False)
        except ValueError as error:
            raise ValueError(f"--init {path}: {error}") from None
        return "run", model
    if (path / "config.json").is_file():
        from titan_audit.models import check_pretrained

        try:  # config.json, the safetensors headers, every tensor's name and shape
            return "hf", check_pretrained(path)
        except ValueError as error:
            raise ValueError(f"--init {path}: {error}") from None
    raise ValueError(f"--init {path}: neither a run directory (manifest.json) nor an HF model directory (config.json)")


def run_model_config(run: Path, where: str) -> ModelConfig:
    """The model config in the manifest of the run in `run` (ValueError prefixed with `where`)."""
    model = read_manifest(run).get("config", {}).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{where}: its manifest.json has no model config")
    return typed_config.build(ModelSection, model, f"{where} model").model_config()


def check_init(init: str | os.PathLike | None, section: ModelSection) -> str:
    """The init's kind, after checking that its model has the shape of the config's (ValueError)."""
    kind, init_model = init_kind(init)
    if init_model is not None:
        differences = model_differences(init_model, section.model_config())
        if differences:
            raise ValueError(
                f"--init {init}: its model has another shape than the config's model "
                f"({section.preset}): {'; '.join(differences[:3])}"
            )
    return kind


# ---------------------------------------------------------------------------------- the config
def explicit_model(source: str, recipes: dict[str, dict[str, Any]], overrides) -> dict[str, Any]:
    """The model keys the user set: the TOML file's own (not its base recipe's) and --set's."""
    own = {} if source in recipes else {k: v for k, v in typed_config.load_toml(source).items() if k != "recipe"}
    model = typed_config.apply_overrides(own, list(overrides)).get("model", {})
    return model if isinstance(model, dict) else {}


def model_with_shape(model: dict[str, Any], explicit: dict[str, Any], shape: ModelConfig, label: str) -> dict[str, Any]:
    """`model` (a config's model section) with `shape`: the preset kept, `overrides` = the fields
    where `shape` differs from it; ValueError if an `explicit` key contradicts `shape`."""
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    want = shape.to_dict()
    claims = explicit.get("overrides", {})
    claims = {k: v for k, v in claims.items() if k in fields} if isinstance(claims, dict) else {}
    for key in sorted(claims):
        if claims[key] != want[key]:
            raise ValueError(
                f"model.overrides.{key} = {claims[key]!r} contradicts {label}: its model has {key} = {want[key]!r}"
            )
    if isinstance(explicit.get("preset"), str):
        claimed = {**get_preset(explicit["preset"]).to_dict(), **claims}
        wrong = [k for k in fields if claimed[k] != want[k]]
        if wrong:
            k = wrong[0]
            raise ValueError(
                f"model.preset = {explicit['preset']!r} contradicts {label}: the preset has {k} = {claimed[k]!r}, "
                f"the init {k} = {want[k]!r} (leave model.preset out to take the init's shape)"
            )
    preset = model.get("preset", ModelSection.preset)
    base = get_preset(preset).to_dict() if isinstance(preset, str) else {}
    given = model.get("overrides")
    unknown = {k: v for k, v in given.items() if k not in fields} if isinstance(given, dict) else {}
    # an unknown key stays, for ModelSection to refuse by name (nothing is dropped silently)
    return {**model, "overrides": {**{k: v for k, v in want.items() if base.get(k) != v}, **unknown}}


# ---------------------------------------------------------------------------------- the manifest
def saved_init(out: str | os.PathLike) -> str | None:
    """The init source recorded by the run in `out` (None: none, or no run there)."""
    if not is_run_dir(Path(out)):
        return None
    section = read_manifest(Path(out)).get("init") or {}
    return section.get("source")


def same_source(a: str | os.PathLike, b: str | os.PathLike | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def check_resume_init(out: Path, init: str | os.PathLike | None) -> None:
    """On a resume: an --init given must name the run's own (ValueError naming both)."""
    saved = saved_init(out)
    if init is not None and not same_source(init, saved):
        raise ValueError(f"{out}: --init {init} differs from the run's ({saved or 'none: it started from its seed'})")


def init_record(init: str | os.PathLike | None) -> dict[str, Any]:
    """A new run's manifest `init` section, before its weights are loaded (`record_init_weights`)."""
    kind, _ = init_kind(init)
    record: dict[str, Any] = {"source": None if init is None else str(init), "kind": kind}
    if kind == "run":
        record["step"] = Checkpointer(init).steps()[-1]
    return record


def record_init_weights(run, model: torch.nn.Module) -> None:
    """A new run records its initial weights' digest (written by run.begin); a run that loaded its
    init again (resume) checks that the digest did not change."""
    digest = weights_digest(model)
    section = run.manifest["init"]
    if not run.resume:
        section["weights"] = digest
    elif section.get("weights") not in (None, digest):
        raise ValueError(f"--init {section['source']}: its weights changed since the run started")


# ---------------------------------------------------------------------------------- the weights
def load_run_init(run, model: torch.nn.Module) -> bool:
    """The train loop's start: the init its manifest names loaded into `model` (whole or sharded)
    and its digest recorded (checked on a resume), unless a resume's checkpoint replaces the
    weights anyway. Whether it loaded (if not, the caller initialises from the seed)."""
    init = (run.manifest.get("init") or {}).get("source")
    if init is None or (run.resume and run.checkpointer.steps()):
        return False
    load_init(model, init)
    record_init_weights(run, model)
    return True


def load_init(model: torch.nn.Module, init: str | os.PathLike, *, portable: bool = False) -> str:
    """Load the init's weights into `model` (of its shape; materialised, whole or with DTensor
    parameters sharded any way): each rank reads only the pieces it holds. Its kind. `portable`
    is not used (no optimizer is built to load the weights); callers may still pass it."""
    kind, _ = init_kind(init)
    if kind == "run":
        load_checkpoint(init, None, model)
    elif kind == "hf":
        from titan_audit.models.hf_shards import load_pretrained_into

        load_pretrained_into(model, init)
    return kind


def load_checkpoint(
    run: str | os.PathLike, step: int | None, model: torch.nn.Module, *, portable: bool = False
) -> dict:
    """Checkpoint `step` (None: the newest, no fallback) of `run` into `model`, its model tensors
    verified against hashes.json; the checkpoint's trainer state. Only the model's part is read
    (DCP into the model's own layout: a sharded model reads its shards): no optimizer is built and
    the optimizer state stays on disk. `portable` is not used (kept for callers)."""
    checkpointer = Checkpointer(run)
    state = checkpointer.load_latest(model, None) if step is None else checkpointer.load(step, model, None)
    assert state is not None, f"{run}: no checkpoint (init_kind checks that first)"
    return state


def weights_digest(model: torch.nn.Module) -> str:
    return fingerprint(digest_tensor(fingerprint_many(model.state_dict())))


def digest_tensor(fingerprints: dict[str, str]) -> torch.Tensor:
    """One uint8 tensor standing for a whole fingerprint map (what the rollout record hashes)."""
    text = "\n".join(f"{k}={fingerprints[k]}" for k in sorted(fingerprints)).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)
