"""Where an RL run's policy starts: a train (or RL) run's latest checkpoint, an HF model
directory, or the deterministic init of (config.model, seed).

Guarantees: `init_kind` names the source or raises a ValueError saying what the path is not;
a run's checkpoint loads verified against its hashes.json; `weights_digest` is one fingerprint of
the whole state dict (recorded in the manifest, so a resume whose init changed is refused).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from titan_audit.audit.fingerprint import fingerprint, fingerprint_many
from titan_audit.models import ModelConfig, Transformer, build
from titan_audit.rl.config import RLConfig
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import ModelSection
from titan_audit.trainer.optim import build_optimizer
from titan_audit.trainer.run_dir import read_manifest
from titan_audit.trainer.typed_config import build as build_typed


def model_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    return [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


def init_kind(init: str | os.PathLike | None) -> tuple[str, ModelConfig | None]:
    """('none' | 'run' | 'hf', the init's model config); ValueError for anything else."""
    if init is None:
        return "none", None
    path = Path(init)
    if (path / "manifest.json").is_file():
        manifest = read_manifest(path)
        model = manifest.get("config", {}).get("model")
        if not isinstance(model, dict):
            raise ValueError(f"--init {path}: its manifest.json has no model config")
        section = build_typed(ModelSection, model, f"--init {path} model")
        if not Checkpointer(path).steps():
            raise ValueError(f"--init {path}: the run has no checkpoint")
        try:  # the newest checkpoint's small files, as load_latest will read them (no fallback)
            Checkpointer(path).preflight(fallback=False)
        except ValueError as error:
            raise ValueError(f"--init {path}: {error}") from None
        return "run", section.model_config()
    if (path / "config.json").is_file():
        from titan_audit.models import check_pretrained

        try:  # config.json, the safetensors headers, every tensor's name and shape
            return "hf", check_pretrained(path)
        except ValueError as error:
            raise ValueError(f"--init {path}: {error}") from None
    raise ValueError(f"--init {path}: neither a run directory (manifest.json) nor an HF model directory (config.json)")


def load_initial_model(config: RLConfig, init: str | os.PathLike | None) -> Transformer:
    """The policy's starting weights: a train (or RL) run's latest checkpoint, an HF directory, or
    the deterministic init of (config.model, seed)."""
    kind, _ = init_kind(init)
    model = build(config.model.model_config(), seed=config.seed)
    if kind == "run":
        # a scratch optimizer to load into (its state is dropped); portable in BI mode, so that the
        # state init torch runs before a load computes with exact ops only (the op census)
        optimizer = build_optimizer(
            [p for p in model.parameters()], config.optimizer, portable=config.determinism.batch_invariant
        )
        Checkpointer(init).load_latest(model, optimizer)  # verified against its hashes.json
    elif kind == "hf":
        from titan_audit.models import from_pretrained

        loaded = from_pretrained(init, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
    return model


def weights_digest(model: torch.nn.Module) -> str:
    return fingerprint(digest_tensor(fingerprint_many(model.state_dict())))


def digest_tensor(fingerprints: dict[str, str]) -> torch.Tensor:
    """One uint8 tensor standing for a whole fingerprint map (what the rollout record hashes)."""
    text = "\n".join(f"{k}={fingerprints[k]}" for k in sorted(fingerprints)).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)
