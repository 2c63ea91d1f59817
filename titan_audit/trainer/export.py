"""Export a run's checkpoint as a Hugging Face model directory (`titan-audit export`).

    result = export_run("runs/a", "hf/a")                  # the newest checkpoint
    result = export_run("runs/a", "hf/a4", step=4)         # checkpoint step_4
    result.to_dict()    # {"path", "run", "step", "files", "weights"}: the --json keys

Guarantees:
- What is exported is the checkpoint's bits: it loads verified against its hashes.json (a changed
  byte stops the export, naming the checkpoint), and the float32 master weights are written
  as they are (models/hf.py `save_pretrained`: config.json + model.safetensors, Qwen3 / Qwen3-MoE /
  Llama layout). `transformers.AutoModelForCausalLM.from_pretrained(DIR)` gives our logits within
  the HF parity tolerance (tests/models/test_hf_parity.py), and `from_pretrained` here (or
  `train --init DIR`) gives back the same bits: `weights` is `init.weights_digest` of the state
  dict, the digest a run started from the export records in its manifest.
- generation_config.json holds the run's tokenizer's eos and pad ids where the run says which (the
  byte tokenizer of the synthetic corpus and of the RL tasks, a token store's info); no other file.
- Checked before anything is written (ValueError, one line): the run (its manifest's model, which
  must have an HF layout transformers runs: no shared expert), the step (an unknown one: the line
  lists the available steps), --out (not a file, not a run, not inside or holding one; empty or
  missing unless `overwrite`).
- Written atomically, under the output's lock (atomic.output_lock): a temporary sibling directory
  renamed into place once complete, so --out holds the whole export or what it held before.
  overwrite="move" (--overwrite) moves an old --out aside to OUT.replaced-<UTC time>, said in the
  log; "delete" (--overwrite=delete) replaces it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_audit.atomic import atomic_output_dir, move_aside, output_lock
from titan_audit.log import get_logger
from titan_audit.models import ModelConfig
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.init import load_checkpoint, run_model_config, weights_digest
from titan_audit.trainer.run_dir import OVERWRITE_MODES, has_entries, is_run_dir, read_manifest

log = get_logger(__name__)

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ExportResult:
    path: Path
    run: Path
    step: int
    files: list[str]  # the file names in `path`, sorted
    weights: str  # init.weights_digest of the exported state dict

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "run": str(self.run),
            "step": self.step,
            "files": self.files,
            "weights": self.weights,
        }


def export_run(
    run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, overwrite: bool | str = False
) -> ExportResult:
    """Write checkpoint `step` (None: the newest) of `run` to `out` as an HF model directory."""
    run, out = Path(run), Path(out)
    model_config, step = check_export(run, out, step=step, overwrite=overwrite)
    from titan_audit.models import build, save_pretrained

    model = build(model_config)
    load_checkpoint(run, step, model, portable=False)  # verified against hashes.json
    digest = weights_digest(model)
    generation = _generation_config(read_manifest(run))
    with output_lock(out):
        replace = out.is_dir()
        move = replace and has_entries(out) and overwrite in (True, "move")
        with atomic_output_dir(out, overwrite=replace) as tmp:
            save_pretrained(model, tmp)
            if generation is not None:
                (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
            files = sorted(p.name for p in tmp.iterdir())
            if move:  # the old one aside only once the new one is complete
                aside = move_aside(out)
                log.info(
                    "--overwrite: the old contents of %s are now in %s (--overwrite=delete removes them)", out, aside
                )
    return ExportResult(out, run, step, files, digest)


def check_export(run: Path, out: Path, *, step: int | None, overwrite: bool | str) -> tuple[ModelConfig, int]:
    """(the run's model config, the step to export); ValueError naming what is wrong, nothing written."""
    from titan_audit.models.hf_config import config_to_hf

    if not is_run_dir(run):
        raise ValueError(f"{run}: not a run directory (no manifest.json)")
    model_config = run_model_config(run, str(run))
    if model_config.shared_expert_intermediate_size:
        raise ValueError(
            f"{run}: its model has a shared expert (shared_expert_intermediate_size = "
            f"{model_config.shared_expert_intermediate_size}), which transformers' Qwen3-MoE does not run"
        )
    try:  # the layout transformers reads (an MoE model without q/k-norm has none)
        config_to_hf(model_config, torch.float32)
    except ValueError as error:
        raise ValueError(f"{run}: {error}") from None
    steps = Checkpointer(run).steps()
    if not steps:
        raise ValueError(f"{run}: the run has no checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"{run}: no checkpoint at step {step}; available steps: {', '.join(map(str, steps))}")
    check_out(out, overwrite=overwrite)
    return model_config, step


def check_out(out: Path, *, overwrite: bool | str) -> None:
    """--out of an export: not a file, not a run, not inside or holding one; empty unless overwrite."""
    if overwrite not in (False, True, *OVERWRITE_MODES):
        raise ValueError(f"--overwrite={overwrite}: expected one of {', '.join(OVERWRITE_MODES)}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    resolved = Path(os.path.realpath(out))
    for path in (resolved, *resolved.parents):
        if is_run_dir(path):
            raise ValueError(f"--out {out}: inside the run {path}; put the export outside any run's directory")
    if out.is_dir() and has_entries(out):
        if not overwrite:
            raise ValueError(f"--out {out}: is not empty; use --overwrite to replace it")
        below = next((Path(root) for root, _, _ in os.walk(out) if is_run_dir(Path(root))), None)
        if below is not None:
            raise ValueError(f"--out {out}: holds the run {below}; an export never replaces a run")


def _generation_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """eos and pad ids of the run's tokenizer, where the run says which (None otherwise)."""
    from titan_audit.data import ByteTokenizer, TokenStore

    config = manifest.get("config", {})
    store = (config.get("data") or {}).get("store") if manifest.get("kind", "train") == "train" else None
    if store is None:  # the synthetic corpus and the RL tasks: the byte tokenizer
        eos, pad = ByteTokenizer.eos_id, ByteTokenizer.pad_id
    else:
        try:
            info = TokenStore(store).info
        except (ValueError, OSError):
            log.info("generation_config.json not written: the run's token store %s does not open", store)
            return None
        eos, pad = info.eos_id, info.pad_id
    return {"eos_token_id": eos, "pad_token_id": pad}
