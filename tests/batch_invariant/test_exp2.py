"""cpu/exp2.py: in an `aligned_numel` buffer, every element's 2**x has the bits of the vector
routine, whatever the buffer's length, the element's offset or the thread count (1 to 4).

Reference: each value computed in a 64-element buffer (one thread, whole vectors). Negative
control: plain `torch.exp2` over unaligned lengths gives some elements other bits, so the
comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from batch_invariant._helpers import num_threads

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.cpu.exp2 import GRAIN, VECTOR_STEP, aligned_numel, exp2_


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 60 - 50


def _reference(x: torch.Tensor) -> torch.Tensor:
    pad = aligned_numel(x.numel()) if x.numel() <= GRAIN else -(-x.numel() // VECTOR_STEP) * VECTOR_STEP
    buf = torch.zeros(pad)
    buf[: x.numel()] = x
    return torch.cat([torch.exp2(buf[i : i + VECTOR_STEP]) for i in range(0, pad, VECTOR_STEP)])[: x.numel()]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 100, GRAIN - 3, GRAIN + 5, 2 * GRAIN + 1, 5 * GRAIN + 77])
def test_aligned_exp2_bits_do_not_depend_on_length_offset_or_threads(threads: int, numel: int) -> None:
    x = _values(numel + 40, seed=numel)
    expected = _reference(x)
    with num_threads(threads):
        for offset in (0, 17, 40):
            values = x[offset : offset + numel]
            buf = torch.full((aligned_numel(numel),), float("nan"))  # padding: anything
            buf[:numel] = values
            exp2_(buf)
            assert_bitwise_equal(buf[:numel], expected[offset : offset + numel], f"exp2_ at offset {offset}")


def test_aligned_lengths() -> None:
    with num_threads(2):
        assert aligned_numel(1) == VECTOR_STEP and aligned_numel(GRAIN) == GRAIN
        assert aligned_numel(GRAIN + 1) == 2 * GRAIN and aligned_numel(3 * GRAIN) == 4 * GRAIN
    with num_threads(3):
        assert aligned_numel(3 * GRAIN) == 3 * GRAIN and aligned_numel(3 * GRAIN + 1) == 6 * GRAIN
    with pytest.raises(AssertionError):
        exp2_(torch.zeros(GRAIN + 1))


def test_negative_control_plain_exp2_over_unaligned_lengths_differs() -> None:
    """Buffers of 31 elements never fill a vector step: their scalar path gives other bits."""
    x = _values(4096, seed=1)
    pieces = torch.cat([torch.exp2(x[i : i + 31]) for i in range(0, 4096, 31)])
    assert not bitwise_equal(pieces, _reference(x)), "expected scalar-path elements to differ"


def test_exp_via_exp2_is_exp_within_float32_rounding_and_position_free() -> None:
    from titan_audit.batch_invariant.cpu.exp2 import LOG2_E, exp_via_exp2

    x = _values(3 * 1000, seed=3).view(3, 1000)
    shift = x.amax(dim=-1, keepdim=True)
    got = exp_via_exp2(x, shift)
    expected = _reference(((x - shift) * LOG2_E).reshape(-1)).view(3, 1000)
    assert_bitwise_equal(got, expected, "exp_via_exp2")
    assert_bitwise_equal(exp_via_exp2(x[1:2], shift[1:2]), got[1:2], "one row alone")
    exact = torch.exp(x.double() - shift.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-7 * 60 + 2e-7, atol=0.0)
    x64 = x.double()
    assert_bitwise_equal(exp_via_exp2(x64), torch.exp(x64), "float64 keeps torch.exp")


@pytest.mark.parametrize("threads", [1, 2])
def test_exp2_of_zero_is_exactly_one(threads: int) -> None:
    """The attention divides by max(l, 1), which is l only if a row's maximum contributes
    exactly 1 (2**0) to l; -inf must give exactly 0 (hidden keys)."""
    with num_threads(threads):
        buf = torch.zeros(aligned_numel(5 * GRAIN))
        buf[1::2] = float("-inf")
        exp2_(buf)
    assert bool((buf[0::2] == 1.0).all()) and bool((buf[1::2] == 0.0).all())


@pytest.mark.parametrize("numel", [100, GRAIN + 5, 5 * GRAIN + 77])
def test_piecewise_path_under_omp_dynamic_gives_the_same_bits(numel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _values(numel, seed=numel + 1)
    with num_threads(2):
        length = aligned_numel(numel)
        parallel = torch.zeros(length)
        parallel[:numel] = x
        exp2_(parallel)
        monkeypatch.setenv("OMP_DYNAMIC", "TRUE")
        piecewise = torch.zeros(length)
        piecewise[:numel] = x
        exp2_(piecewise)
    assert_bitwise_equal(piecewise, parallel, "piecewise vs parallel exp2_")
    assert_bitwise_equal(piecewise[:numel], _reference(x), "piecewise vs reference")
