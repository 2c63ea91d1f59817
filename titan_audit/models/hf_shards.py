"""An HF checkpoint's weights read straight into a model's parameters, each rank its own piece.

    load_pretrained_into(model, "hf/qwen3")   # model: materialised, whole or sharded (DTensors)

Guarantees: every parameter gets the bits `from_pretrained(path, dtype=param.dtype)` gives it
(the stored elements, cast elementwise to the parameter's dtype); a DTensor parameter reads only
its local block (models/local_shard.py) through safetensors' `get_slice`, so no rank holds more
than one parameter's local piece beyond the model, never a second model. Checked first, without
reading a tensor: config.json against the safetensors files (hf.py's checks) and against the
model's config (ValueError naming the file). A tied checkpoint's stored `lm_head.weight` must
equal the embedding: compared in row blocks of at most `_COMPARE_ELEMENTS`, on every rank, so
every rank gives the same answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from titan_audit.audit.bitwise import bitwise_equal
from titan_audit.models.hf import _EXPERT_PARAM, _hf_name, _matched_checkpoint
from titan_audit.models.local_shard import LocalBlock, local_block
from titan_audit.models.transformer import Transformer

_COMPARE_ELEMENTS = 1 << 22  # rows of the tied-head check read at once, at most this many elements


@torch.no_grad()
def load_pretrained_into(model: Transformer, path: str | os.PathLike[str]) -> None:
    """Fill every parameter's local piece of `model` from the HF checkpoint at `path`."""
    config, checkpoint, _, tied_head = _matched_checkpoint(Path(path))
    differing = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(model.config, f.name)]
    if differing:
        key = differing[0]
        raise ValueError(
            f"{Path(path) / 'config.json'}: {key} = {getattr(config, key)!r}, the model to load into has "
            f"{getattr(model.config, key)!r}"
        )
    with contextlib.ExitStack() as stack:
        files = {file: stack.enter_context(safe_open(str(file), "pt")) for file in set(checkpoint.where.values())}

        def read(key: str, index: tuple[slice, ...]) -> torch.Tensor:
            return files[checkpoint.where[key]].get_slice(key)[index]

        if tied_head is not None:
            _check_tied(read, checkpoint.shapes[tied_head], checkpoint.description)
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            block = local_block(param)
            if block.numel:
                local.copy_(_read_block(read, name, block))


def _read_block(read, name: str, block: LocalBlock) -> torch.Tensor:
    """Parameter `name`'s block from the files (a stacked expert parameter [E, ...] from the E
    per-expert tensors its expert rows cover)."""
    index = block.index()
    match = _EXPERT_PARAM.match(name)
    if match is None:
        return read(_hf_name(name), index)
    layer, proj = match.groups()
    experts = range(index[0].start, index[0].stop)
    return torch.stack([read(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", index[1:]) for e in experts])


def _check_tied(read, shape: tuple[int, ...], description: str) -> None:
    rows = max(1, _COMPARE_ELEMENTS // max(1, shape[1]))
    for start in range(0, shape[0], rows):
        index = (slice(start, min(start + rows, shape[0])), slice(0, shape[1]))
        if not bitwise_equal(read("lm_head.weight", index), read("model.embed_tokens.weight", index)):
            raise ValueError(
                f"{description}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
            )
