"""The unit a trainer consumes: one virtual microbatch, as small typed tensors.

Shapes (M = microbatch size in sequences, L = sequence length), all on the CPU as the loader
makes them (`to(device)`: the same values on the trainer's device, for a `parallel.device = "cuda"` run):
    sequence_ids  int64 [M]     packed-sequence index of each row (packing.py)
    tokens        int64 [M, L]  input ids
    targets       int64 [M, L]  next-token ids: targets[:, i] is what position i predicts (the
                                shift is done here; no further shifting in the trainer)
    positions     int64 [M, L]  position inside the token's document (RoPE); 0 on padding
    doc_ids       int64 [M, L]  store document index; -1 on padding
    loss_mask     bool  [M, L]  True where the target is the next token of the same document
The loss of a microbatch is sum(loss_mask * token_loss) / global_loss_tokens, where
global_loss_tokens is loss_mask summed over the whole global batch (all V microbatches), the same
number on every rank and computed from the plan without reading other ranks' data.
`attention_mask()` is the per-document causal mask [M, L, L] (query i may see key j iff j <= i and
doc_ids match).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from titan_audit.audit.fingerprint import fingerprint

TENSOR_FIELDS = ("sequence_ids", "tokens", "targets", "positions", "doc_ids", "loss_mask")


@dataclass(frozen=True)
class Microbatch:
    epoch: int
    step: int  # step within the epoch
    index: int  # global virtual-microbatch index in [0, V)
    num_microbatches: int  # V
    global_loss_tokens: int
    sequence_ids: torch.Tensor
    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def from_arrays(
        cls,
        epoch: int,
        step: int,
        index: int,
        num_microbatches: int,
        global_loss_tokens: int,
        arrays: dict[str, np.ndarray],
    ) -> Microbatch:
        return cls(
            epoch,
            step,
            index,
            num_microbatches,
            global_loss_tokens,
            **{name: torch.from_numpy(arrays[name]) for name in TENSOR_FIELDS},
        )

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> Microbatch:
        """This microbatch with every tensor on `device` (copies of the same values; on the device
        they are already on, the same tensors: no copy)."""
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in TENSOR_FIELDS})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def fingerprints(self) -> dict[str, str]:
        return {name: fingerprint(t) for name, t in self.tensors().items()}

    def attention_mask(self) -> torch.Tensor:
        L = self.tokens.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        same_doc = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]
        return same_doc & causal


def concat(microbatches: list[Microbatch]) -> dict[str, torch.Tensor]:
    """Row-wise concatenation of each tensor field, in the order given."""
    assert microbatches, "nothing to concatenate"
    return {name: torch.cat([getattr(m, name) for m in microbatches]) for name in TENSOR_FIELDS}
