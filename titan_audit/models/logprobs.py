"""Per-token log-probabilities of given targets, shared by the trainer and every generator.

`token_logprobs(logits, targets)` = log_softmax(logits in float32)[..., target], float32. In
batch-invariant mode it uses the BI log_softmax, so a token's log-prob depends only on its own
logits row: the generator's reported log-prob and the trainer's recomputation agree bitwise
whenever their logits do (G4).
"""

from __future__ import annotations

import torch

from titan_audit.models import ops


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [..., V], targets [...] (int, in [0, V)) -> log p(target) [...] in float32."""
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    vocab = logits.shape[-1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}), got [{int(targets.min())}, {int(targets.max())}]")
    logp = ops.log_softmax(logits.float(), -1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
