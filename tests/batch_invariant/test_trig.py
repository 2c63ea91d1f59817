"""cos/sin and the RoPE frequencies on our kernels (cpu/trig.py): same bits on every ISA variant,
accurate against float64. Knob independence (ATEN_CPU_CAPABILITY, MKL_CBWR) is in test_knobs.py.
Negative control: another angle gives other bits, so the cross-variant comparison is not vacuous."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu.trig import cos_sin, rope_inv_freq


def _angles() -> torch.Tensor:
    g = np.random.Generator(np.random.Philox(0))
    a = np.concatenate([g.uniform(-7, 7, 50_000), g.uniform(0, 60_000, 50_000), [0.0, -0.0, np.pi, 1e-30]])
    return torch.from_numpy(a.astype(np.float32))


def test_every_variant_gives_the_same_bits() -> None:
    a = _angles()
    results = []
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            results.append(torch.cat(cos_sin(a) + (rope_inv_freq(1e6, 128), rope_inv_freq(1e4, 64))))
    assert all(bitwise_equal(r, results[0]) for r in results)
    assert not bitwise_equal(torch.cat(cos_sin(a + 1e-3)), torch.cat(cos_sin(a)))


def test_accuracy_against_float64() -> None:
    a = _angles()
    c, s = cos_sin(a)
    for got, ref in ((c, np.cos(a.double().numpy())), (s, np.sin(a.double().numpy()))):
        err = np.abs(got.double().numpy() - ref)
        assert err.max() < 1.2e-7  # float32 rounding of values in [-1, 1] (1 ulp at 1 is 1.19e-7)
    assert float(c[-4]) == 1.0 and float(s[-4]) == 0.0
    exponent = np.arange(0, 128, 2) / 128
    assert np.abs(rope_inv_freq(1e6, 128).double().numpy() / (1e6**-exponent) - 1).max() < 2e-7


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="float32 CPU"):
        cos_sin(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="even head_dim"):
        rope_inv_freq(1e4, 7)
