"""Load and save Hugging Face checkpoints: `config.json` + `model.safetensors`.

Layouts: Qwen3 (`Qwen3ForCausalLM`), Qwen3-MoE (`Qwen3MoeForCausalLM`, per-expert weights
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`) and Llama (`LlamaForCausalLM`).
Module names here mirror HF's, so a tensor's HF name is "model." + our name (except `lm_head`),
and stacked expert weights [E, ...] split into E per-expert tensors.

`from_pretrained(path, dtype=None)`:
- reads `config.json` (see `hf_config.py`) and `model.safetensors` or a sharded
  `model.safetensors.index.json`;
- checks every tensor name and shape before loading; missing, unexpected and mis-shaped tensors
  are reported together in one `ValueError` that names the file (a tied checkpoint may carry an
  `lm_head.weight` only if it equals the embedding);
- dtype None keeps the stored dtype.

`save_pretrained(model, path, overwrite=False)`:
- refuses an existing non-empty directory unless `overwrite=True` (`ValueError`);
- writes every file to a temporary name in the target directory, fsyncs it and renames it into
  place, so a crash never leaves a half-written `config.json` or `model.safetensors`; with
  overwrite, stale shard files of an older sharded checkpoint are removed afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_audit.audit.bitwise import bitwise_equal
from titan_audit.models.config import ModelConfig
from titan_audit.models.hf_config import config_from_hf, config_to_hf
from titan_audit.models.transformer import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under their HF names (stacked experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = _EXPERT_PARAM.match(name)
        if match:
            layer, proj = match.groups()
            for expert in range(tensor.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"] = tensor[expert]
        else:
            out[_hf_name(name)] = tensor
    return out


def _expected_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in to_hf_state_dict(model).items()}


class _Checkpoint:
    """The safetensors file(s) of a checkpoint directory: name -> (file, shape, dtype)."""

    def __init__(self, directory: Path) -> None:
        single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
        if single.is_file():
            files = {single}
            self.description = str(single)
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index}: not a safetensors index ({error})") from None
            files = {directory / f for f in set(weight_map.values())}
            self.description = str(index)
        else:
            raise ValueError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in sorted(files):
            if not file.is_file():
                raise ValueError(f"{self.description}: shard {file.name} is missing")
            try:
                with safe_open(str(file), "pt") as handle:
                    for key in handle.keys():
                        view = handle.get_slice(key)
                        self.where[key] = file
                        self.shapes[key] = tuple(view.get_shape())
                        self.dtypes[key] = view.get_dtype()
            except Exception as error:  # safetensors raises its own error types
                raise ValueError(f"{file}: cannot read safetensors ({error})") from None

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.where[key], []).append(key)
        for file, file_keys in by_file.items():
            with safe_open(str(file), "pt") as handle:
                for key in file_keys:
                    out[key] = handle.get_tensor(key)
        return out


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{file}: not found")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: invalid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config_from_hf(data, str(file))


def check_pretrained(path: str | os.PathLike[str]) -> ModelConfig:
    """The model config stored at `path` (HF layout), after checking what can be checked without
    reading a tensor: config.json, the safetensors headers, every tensor's name and shape
    (ValueError naming the file). What `from_pretrained` checks before it loads."""
    return _matched_checkpoint(Path(path))[0]


def _matched_checkpoint(directory: Path) -> tuple[ModelConfig, _Checkpoint, dict[str, tuple[int, ...]], str | None]:
    """(config, checkpoint, expected shapes, tied head name or None), checked against each other."""
    config = load_config(directory)
    checkpoint = _Checkpoint(directory)
    with torch.device("meta"):
        model = Transformer(config)
    expected = _expected_shapes(model)

    stored = dict(checkpoint.shapes)
    tied_head = None
    if config.tie_word_embeddings and "lm_head.weight" in stored:
        tied_head = "lm_head.weight"
        del stored[tied_head]
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    misshaped = sorted(
        f"{k}: expected {list(expected[k])}, found {list(stored[k])}"
        for k in set(expected) & set(stored)
        if expected[k] != stored[k]
    )
    if missing or unexpected or misshaped:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                parts.append(f"{label} tensors ({len(items)}): " + ", ".join(items))
        raise ValueError(f"{checkpoint.description}: checkpoint does not match config.json; " + "; ".join(parts))
    return config, checkpoint, expected, tied_head


def from_pretrained(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Transformer:
    """The model stored at `path` (HF layout); see the module doc."""
    config, checkpoint, expected, tied_head = _matched_checkpoint(Path(path))
    with torch.device("meta"):
        model = Transformer(config)
    tensors = checkpoint.load(sorted(expected) + ([tied_head] if tied_head else []))
    if tied_head and not bitwise_equal(tensors[tied_head], tensors["model.embed_tokens.weight"]):
        raise ValueError(
            f"{checkpoint.description}: tie_word_embeddings is true but lm_head.weight differs from "
            "model.embed_tokens.weight"
        )
    if dtype is None:
        dtype = tensors["model.embed_tokens.weight"].dtype
    state: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        match = _EXPERT_PARAM.match(name)
        if match:
            layer, proj = match.groups()
            parts = [tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] for e in range(param.shape[0])]
            state[name] = torch.stack(parts).to(dtype)
        else:
            state[name] = tensors[_hf_name(name)].to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(temp)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, target)
    finally:
        if temp.exists():
            temp.unlink()


def save_pretrained(model: Transformer, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write `model` to directory `path` in the HF layout; see the module doc. Returns the path."""
    if not isinstance(model, Transformer):
        raise ValueError(f"save_pretrained expects a titan_audit Transformer, got {type(model).__name__}")
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise ValueError(f"{directory}: directory is not empty; pass overwrite=True to replace it")
    directory.mkdir(parents=True, exist_ok=True)

    dtype = model.embed_tokens.weight.dtype
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_hf_state_dict(model).items()}
    config_text = json.dumps(config_to_hf(model.config, dtype), indent=2, sort_keys=True) + "\n"
    _write_atomic(directory / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write_atomic(directory / CONFIG_NAME, lambda p: p.write_text(config_text))
    stale = [directory / INDEX_NAME, *directory.glob("model-*-of-*.safetensors")]
    for file in stale:
        if file.exists():
            file.unlink()
    return directory
