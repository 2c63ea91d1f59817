"""Where an RL run's policy starts: a train (or RL) run's latest checkpoint, an HF model
directory, or the deterministic init of (config.model, seed). The logic is shared with
`train --init` (trainer/init.py); this file builds the policy.

Guarantees (trainer/init.py's): the init's weights load bitwise (a run's checkpoint verified
against its hashes.json) into a model of the config's shape, which the launcher took from the
init; the loop records their digest, so a resume whose init changed is refused.
"""

from __future__ import annotations

import os

from titan_audit.models import Transformer, build
from titan_audit.rl.config import RLConfig
from titan_audit.trainer.init import load_init


def load_initial_model(config: RLConfig, init: str | os.PathLike | None) -> Transformer:
    """The policy's starting weights: a train (or RL) run's latest checkpoint, an HF directory, or
    the deterministic init of (config.model, seed); on the CPU, whatever `parallel.device` (the
    loop moves it)."""
    model = build(config.model.model_config(), seed=config.seed)
    if init is not None:
        load_init(model, init, portable=config.determinism.batch_invariant)
    return model
