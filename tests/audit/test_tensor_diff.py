"""tensor_diff: differing elements on raw bits, max abs diff, max ULP distance."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from titan_audit.audit import tensor_diff
from titan_audit.audit.bitwise import bits

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _step_bits(t: torch.Tensor, index: int, ulps: int) -> torch.Tensor:
    """Move element `index` `ulps` representable values away from zero (same sign)."""
    out = t.clone()
    flat = bits(out).reshape(-1)
    flat[index] += ulps
    return flat.view(t.dtype).reshape(t.shape)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_k_ulp_step_is_measured(dtype):
    a = torch.tensor([1.0, -2.0, 0.5, 3.0]).to(dtype)
    b = _step_bits(_step_bits(a, 1, 3), 3, 1)
    d = tensor_diff(a, b)
    assert (d.numel, d.differing_elements, d.max_ulp, d.first_index) == (4, 2, 3, [1])
    expected = max(abs(float(a[i]) - float(b[i])) for i in range(4))
    assert d.max_abs_diff == expected


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_ulps_across_zero_and_signed_zero(dtype):
    tiny = torch.tensor([torch.finfo(dtype).smallest_normal]).to(dtype)
    d = tensor_diff(tiny, torch.tensor([-torch.finfo(dtype).smallest_normal]).to(dtype))
    assert d.max_ulp == 2 * int(bits(tiny).to(torch.int64))
    zero_diff = tensor_diff(torch.tensor([0.0]).to(dtype), torch.tensor([-0.0]).to(dtype))
    assert zero_diff.differing_elements == 1 and zero_diff.max_ulp == 0 and zero_diff.max_abs_diff == 0.0


def test_identical_and_negative_control():
    a = torch.randn(5, 7)
    d = tensor_diff(a, a.clone())
    assert (d.differing_elements, d.max_abs_diff, d.max_ulp, d.first_index) == (0, 0.0, 0, None)


def test_integers_nan_and_bad_input():
    d = tensor_diff(torch.tensor([1, 2, 3]), torch.tensor([1, 9, 3]))
    assert (d.differing_elements, d.max_abs_diff, d.max_ulp) == (1, 7.0, None)
    n = tensor_diff(torch.tensor([math.nan, 1.0]), torch.tensor([2.0, 1.0]))
    assert n.differing_elements == 1 and math.isnan(n.max_abs_diff)
    assert n.to_dict()["max_abs_diff"] == "nan"
    with pytest.raises(ValueError, match="cannot diff"):
        tensor_diff(torch.ones(2), torch.ones(3))


@given(st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(1, 1000))
def test_ulp_matches_nextafter_walk_float32(x, k):
    a = torch.tensor([x], dtype=torch.float32)
    b = a.clone()
    target = torch.tensor([math.inf])
    for _ in range(k):
        b = torch.nextafter(b, target)
    if not torch.isfinite(b).all():
        return
    assert tensor_diff(a, b).max_ulp == k
