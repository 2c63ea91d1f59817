"""models/pointwise.exp/sigmoid/silu (our kernels): an element's bits depend only on its value
(bitwise over row prefixes of one tensor; negative control: the same count sees a function that
computes the last row from inputs moved one ulp, as a kernel with a vector body and a scalar tail
may compute the tail another way), identical under every ISA variant, accurate to a few float32
ulps (vs float64), with gradients that are position independent too and match float64 autograd."""

import pytest
import torch
import torch.nn.functional as F

from titan_audit.audit import assert_bitwise_equal, bits
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.models import pointwise


def _position_differences(fn, x):
    full = fn(x)
    return sum(int((bits(fn(x[:n].contiguous())) != bits(full[:n])).sum()) for n in range(1, 60))


def _grad(fn, x, g):
    leaf = x.detach().clone().requires_grad_()
    (fn(leaf) * g).sum().backward()
    return leaf.grad


@pytest.fixture(scope="module")
def x():
    return torch.randn(200, 37, generator=torch.Generator().manual_seed(0)) * 6


@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu"])
def test_position_independent(x, name):
    assert _position_differences(getattr(pointwise, name), x) == 0
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    fn = getattr(pointwise, name)
    full = _grad(fn, x, g)
    for n in (1, 7, 33, 199):
        assert_bitwise_equal(_grad(fn, x[:n], g[:n]), full[:n], f"{name} grad of {n} rows")


@pytest.mark.control
@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu"])
def test_negative_control_a_last_row_computed_another_way_is_seen(x, name):
    fn = getattr(pointwise, name)
    up = torch.tensor(torch.inf)

    def tail_moved(t: torch.Tensor) -> torch.Tensor:
        return fn(torch.cat([t[:-1], torch.nextafter(t[-1:], up)]))

    assert _position_differences(tail_moved, x) > 0


@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu"])
def test_same_bits_on_every_isa_variant(x, name):
    fn = getattr(pointwise, name)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            results[isa] = (fn(x), _grad(fn, x, g), fn(x.bfloat16()))
    for isa, got in results.items():
        for a, b in zip(got, results["scalar"]):
            assert_bitwise_equal(a, b, f"{name}: {isa} vs scalar")


def test_accuracy_and_range():
    x = torch.linspace(-100, 100, 20001)
    x64 = x.double()
    exp_ref = torch.exp(x64)
    finite = exp_ref < 3.4e38
    normal = exp_ref >= 2.0**-126
    assert ((pointwise.exp(x).double() - exp_ref).abs() / exp_ref)[finite & normal].max() < 1.2e-7
    assert pointwise.exp(x)[~finite].isinf().all()
    silu_ref = F.silu(x64)
    err = (pointwise.silu(x).double() - silu_ref).abs()
    assert (err / silu_ref.abs().clamp_min(1e-30))[x > -80].max() < 3e-7
    assert err[x <= -80].max() < 1e-35  # tiny results: absolute error only
    sig_ref = torch.sigmoid(x64)
    assert ((pointwise.sigmoid(x).double() - sig_ref).abs()).max() < 1e-7
    assert torch.isfinite(pointwise.silu(torch.tensor([-1e30, 1e30, 0.0]))).all()


def test_dtypes_and_gradients_against_float64():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 4
    for name in ("exp", "sigmoid", "silu"):
        fn = getattr(pointwise, name)
        assert fn(x.bfloat16()).dtype == torch.bfloat16
        leaf = x.clone().requires_grad_(True)
        fn(leaf).sum().backward()
        x64 = x.double().requires_grad_(True)
        {"exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu}[name](x64).sum().backward()
        torch.testing.assert_close(leaf.grad.double(), x64.grad, atol=1e-6, rtol=1e-6, msg=name)
        bf = x.bfloat16().requires_grad_(True)
        fn(bf).sum().backward()
        assert bf.grad.dtype == torch.bfloat16


def test_other_devices_are_refused():
    with pytest.raises(NotImplementedError, match="no backend for device type 'meta'"):
        pointwise.silu(torch.empty(3, device="meta"))
