"""deterministic/: global determinism switches, seeding, keyed RNG streams, numerics fingerprint.

with deterministic.enable(seed=0):          # G1: same fingerprint + inputs -> same bits
    ...
gen = deterministic.torch_generator(seed, "dropout", step, sample_id)
fp = deterministic.fingerprint()            # what decides the bits here
deterministic.incompatibilities(fp_a, fp_b)   # why two runs cannot be compared bitwise
"""

from titan_audit.deterministic.numerics import (
    NumericsFingerprint,
    compatible,
    fingerprint,
    incompatibilities,
)
from titan_audit.deterministic.rng import (
    RngState,
    numpy_generator,
    restore,
    seed_all,
    state,
    stream_key,
    torch_generator,
)
from titan_audit.deterministic.switches import DeterministicMode, enable, is_enabled

__all__ = [
    "DeterministicMode",
    "NumericsFingerprint",
    "RngState",
    "compatible",
    "enable",
    "fingerprint",
    "incompatibilities",
    "is_enabled",
    "numpy_generator",
    "restore",
    "seed_all",
    "state",
    "stream_key",
    "torch_generator",
]
