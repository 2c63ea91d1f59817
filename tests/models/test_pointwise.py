"""pointwise.exp/sigmoid/silu: an element's bits depend only on its value (bitwise over row
prefixes of one tensor; negative control: native fp32 F.silu/sigmoid do depend on position on
this CPU), and they are accurate to a few float32 ulps (vs float64)."""

import pytest
import torch
import torch.nn.functional as F

from titan_audit.audit import bits
from titan_audit.models import pointwise


def _position_differences(fn, x):
    full = fn(x)
    return sum(int((bits(fn(x[:n].contiguous())) != bits(full[:n])).sum()) for n in range(1, 60))


@pytest.fixture(scope="module")
def x():
    return torch.randn(200, 37, generator=torch.Generator().manual_seed(0)) * 6


@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu"])
def test_position_independent(x, name):
    assert _position_differences(getattr(pointwise, name), x) == 0


@pytest.mark.parametrize("native", [F.silu, torch.sigmoid])
def test_negative_control_native_kernels_depend_on_position(x, native):
    assert _position_differences(native, x) > 0


def test_accuracy_and_range():
    x = torch.linspace(-100, 100, 20001)
    x64 = x.double()
    exp_ref = torch.exp(x64.clamp(-87, 88))
    assert ((pointwise.exp(x).double() - exp_ref).abs() / exp_ref).max() < 3e-7
    silu_ref = F.silu(x64)
    err = (pointwise.silu(x).double() - silu_ref).abs()
    assert (err / silu_ref.abs().clamp_min(1e-30))[x > -80].max() < 3e-7
    assert err[x <= -80].max() < 1e-35  # clamped tail: absolute error only
    sig_ref = torch.sigmoid(x64)
    assert ((pointwise.sigmoid(x).double() - sig_ref).abs()).max() < 1e-7
    assert torch.isfinite(pointwise.silu(torch.tensor([-1e30, 1e30, 0.0]))).all()


def test_dtypes_and_gradient():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert pointwise.silu(x.bfloat16()).dtype == torch.bfloat16
    x.requires_grad_(True)
    pointwise.silu(x).sum().backward()
    x64 = x.detach().double()
    expected = torch.sigmoid(x64) * (1 + x64 * (1 - torch.sigmoid(x64)))
    torch.testing.assert_close(x.grad.double(), expected, atol=1e-6, rtol=0)
