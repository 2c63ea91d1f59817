"""Random number generation that does not depend on where a sample runs.

Two tools:

1. Global RNG state: `seed_all`, `state()` and `restore()` cover python's `random`, numpy's legacy
   global generator and torch's default generators (CPU and every CUDA device). `restore(state())`
   is an exact round trip, so a checkpoint can carry the state and a resume continues the stream.

2. Counter-based streams keyed by (seed, purpose, step, sample_id). A sample's random numbers are
   a pure function of that key, never of the rank, batch or order in which samples are drawn, so
   they survive a change of world size, batch composition or resume point.

   Key derivation (stable across versions, platforms and processes):
       message = "<Q" seed | "<q" step | "<Q" sample_id | "<I" len(purpose) | purpose (UTF-8)
       key128  = BLAKE2b(message, digest_size=16, person=b"titan-audit/rng1")   (little-endian int)
   `numpy_generator` runs numpy's Philox-4x64 (a counter-based generator) with key = key128.
   `torch_generator` seeds a fresh `torch.Generator` with the low 64 bits of key128 (on CPU a
   Mersenne Twister, on CUDA torch's Philox); the numbers are fixed per device type.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_PERSON = b"titan-audit/rng1"
_U64 = (1 << 64) - 1


@dataclass
class RngState:
    """Every global RNG state this process has; restore() puts it back exactly."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)  # the legacy global generator takes 32 bits
    torch.manual_seed(seed)  # also seeds every CUDA device


def state() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return RngState(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch_cpu=torch.get_rng_state(),
        torch_cuda=cuda,
    )


def restore(saved: RngState) -> None:
    random.setstate(saved.python)
    np.random.set_state(saved.numpy)
    torch.set_rng_state(saved.torch_cpu)
    if saved.torch_cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(saved.torch_cuda):
            raise ValueError(
                f"RNG state holds {len(saved.torch_cuda)} CUDA device(s) but this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        torch.cuda.set_rng_state_all(saved.torch_cuda)


def stream_key(seed: int, purpose: str, step: int, sample_id: int) -> int:
    """The 128-bit key of the stream for (seed, purpose, step, sample_id); see the module doc."""
    for name, value in (("seed", seed), ("sample_id", sample_id)):
        if not 0 <= value <= _U64:
            raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    if not -(1 << 63) <= step < (1 << 63):
        raise ValueError(f"step must fit in int64, got {step}")
    text = purpose.encode("utf-8")
    message = struct.pack("<QqQI", seed, step, sample_id, len(text)) + text
    digest = hashlib.blake2b(message, digest_size=16, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


def numpy_generator(seed: int, purpose: str, step: int, sample_id: int) -> np.random.Generator:
    """A numpy Generator on Philox-4x64 whose key is `stream_key(...)` and counter starts at 0."""
    return np.random.Generator(np.random.Philox(key=stream_key(seed, purpose, step, sample_id)))


def torch_generator(
    seed: int, purpose: str, step: int, sample_id: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh torch.Generator on `device` seeded with the low 64 bits of `stream_key(...)`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_key(seed, purpose, step, sample_id) & _U64)
    return generator
