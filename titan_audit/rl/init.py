"""Where an RL run's policy starts: a train (or RL) run's latest checkpoint, an HF model
directory, or the deterministic init of (config.model, seed). The logic is shared with
`train --init` (trainer/init.py); this file builds the policy.

Guarantees (trainer/init.py's): `init_kind` names the source or raises a ValueError saying what
the path is not; a run's checkpoint loads verified against its hashes.json; `weights_digest` is
one fingerprint of the whole state dict (recorded in the manifest, so a resume whose init changed
is refused).
"""

from __future__ import annotations

import os

from titan_audit.models import Transformer, build
from titan_audit.rl.config import RLConfig
from titan_audit.trainer.init import digest_tensor, init_kind, load_init, model_differences, weights_digest

__all__ = ["digest_tensor", "init_kind", "load_initial_model", "model_differences", "weights_digest"]


def load_initial_model(config: RLConfig, init: str | os.PathLike | None) -> Transformer:
    """The policy's starting weights: a train (or RL) run's latest checkpoint, an HF directory, or
    the deterministic init of (config.model, seed)."""
    model = build(config.model.model_config(), seed=config.seed)
    if init is not None:
        load_init(model, init, portable=config.determinism.batch_invariant)
    return model
