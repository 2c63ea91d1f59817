"""normal_from_bits (weight init): the same bits on every ISA variant, and a sound N(0, 1).

Proves: every variant the CPU has gives identical samples; the samples have the moments and
quantiles of a standard normal; model init depends on (config, seed) only and reproduces.
Negative control: other bits give other samples (the cross-variant check compares real data).
The ATEN_CPU_CAPABILITY independence of the whole init is in tests/batch_invariant/test_knobs.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from titan_audit import models
from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu.random import normal_from_bits

N = 1 << 18


def _bits(seed: int, n: int = N) -> np.ndarray:
    return np.random.Generator(np.random.Philox(seed)).bit_generator.random_raw(n // 2).view(np.uint32)


def test_every_variant_gives_the_same_samples() -> None:
    bits = _bits(0)
    reference = None
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            out = normal_from_bits(bits, 0.5, 2.0)
        reference = out if reference is None else reference
        assert bitwise_equal(out, reference), isa
    assert not bitwise_equal(normal_from_bits(_bits(1), 0.5, 2.0), reference)  # negative control


def test_samples_are_standard_normal() -> None:
    z = normal_from_bits(_bits(3)).double()
    assert abs(float(z.mean())) < 5 / math.sqrt(N)
    assert abs(float(z.std()) - 1) < 0.01
    assert abs(float((z**4).mean()) - 3) < 0.05  # kurtosis
    for q, expected in ((0.5, 0.0), (0.8413447, 1.0), (0.9772499, 2.0), (0.0227501, -2.0)):
        assert abs(float(torch.quantile(z[:100_000], q)) - expected) < 0.03, q
    assert torch.isfinite(z).all()


def test_bad_bits_are_rejected() -> None:
    with pytest.raises(ValueError, match="even length"):
        normal_from_bits(np.zeros(3, dtype=np.uint32))


def test_model_init_is_a_function_of_seed_only() -> None:
    a, b, c = (models.build("tiny-dense", seed=s).state_dict() for s in (0, 0, 1))
    assert all(bitwise_equal(a[k], b[k]) for k in a)
    assert not all(bitwise_equal(a[k], c[k]) for k in a if "norm" not in k)
