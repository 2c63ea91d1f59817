"""sum, mean, softmax, log_softmax and rms_norm are row-invariant, bitwise, and accurate.

Proves: a row's result is the same bits alone, in any slice, and in a batch of 1..512 rows,
for random lengths (including non-powers of two), float32 and bfloat16, 1 and 2 threads; the
element-wise functions the kernels rely on (exp, log, rsqrt) give an element the same bits
wherever it sits in a buffer (plain exp2, which does not, is recorded as a negative control;
the kernels use it only on tail-free buffers, tests in test_exp2.py); results are within
float32 tolerance of float64. Negative
controls: native `torch.sum`/`mean` over a long row give a single row different bits than the
same row in a batch (2 threads split a lone row between them); torch's fused softmax kernel
happens to be row-invariant on this build, which the control records rather than hides.
"""

from __future__ import annotations

import pytest
import torch
from batch_invariant._helpers import DTYPES, num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal

OPS = {
    "sum": lambda x: bi.sum(x, dim=-1),
    "mean": lambda x: bi.mean(x, dim=-1, keepdim=True),
    "softmax": lambda x: bi.softmax(x, dim=-1),
    "log_softmax": lambda x: bi.log_softmax(x, dim=-1),
    "rms_norm": lambda x: bi.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[-1]).to(x.dtype)),
}


@pytest.mark.parametrize("op", sorted(OPS))
@settings(max_examples=200)
@given(data=st.data())
def test_rows_do_not_depend_on_the_batch(op: str, data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 512), label="batch")
    n = data.draw(st.integers(1, 300), label="N")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x = randn(batch, n, seed=seed, dtype=dtype, scale=3.0)
    start = data.draw(st.integers(0, batch - 1), label="start")
    length = data.draw(st.integers(1, batch - start), label="length")
    f = OPS[op]
    with num_threads(threads):
        full = f(x)
        assert_bitwise_equal(f(x[start : start + length]), full[start : start + length], "slice")
        assert_bitwise_equal(f(x[start : start + 1]), full[start : start + 1], "single row")


def test_other_dims_and_3d() -> None:
    x = randn(5, 7, 33, seed=1)
    assert_bitwise_equal(bi.softmax(x, dim=1)[2], bi.softmax(x[2], dim=0))
    assert_bitwise_equal(bi.sum(x, dim=0), bi.sum(x.movedim(0, -1), dim=-1))
    assert_bitwise_equal(bi.log_softmax(x)[1:3], bi.log_softmax(x[1:3]))


def test_elementwise_functions_do_not_depend_on_position() -> None:
    """exp/log/rsqrt of an element: same bits in a long vectorised buffer and alone (scalar tails)."""
    x = torch.rand(4099) * 40 - 20
    pos = x.abs() + 1e-3
    for f, arg in ((torch.exp, x), (torch.log, pos), (torch.rsqrt, pos)):
        whole = f(arg)
        alone = torch.cat([f(arg[i : i + 1]) for i in range(0, 4099, 7)])
        assert_bitwise_equal(alone, whole[::7], f.__name__)
        assert_bitwise_equal(f(arg[3:40]), whole[3:40], f.__name__)


def test_negative_control_exp2_depends_on_position() -> None:
    """exp2 is 3-4x faster than exp here, but its scalar tail and vector body disagree, so an
    element's bits would depend on where it sits in a buffer: the kernels use exp2 only on
    buffers whose length leaves no tail (cpu/exp2.py)."""
    x = torch.rand(4099) * 40 - 20
    whole = torch.exp2(x)
    alone = torch.cat([torch.exp2(x[i : i + 1]) for i in range(0, 4099, 7)])
    assert not bitwise_equal(alone, whole[::7])


def test_negative_control_native_sum_differs_for_a_lone_long_row() -> None:
    x = randn(16, 100_000, seed=2)
    with num_threads(2):
        assert not bitwise_equal(x[:1].sum(-1), x.sum(-1)[:1]), "native sum: expected a difference"
        assert not bitwise_equal(x[:1].mean(-1), x.mean(-1)[:1]), "native mean: expected a difference"
        for name, f in OPS.items():
            assert_bitwise_equal(f(x[:1]), f(x)[:1], name)
        # Recorded, not required: the fused native softmax is row-invariant on this build.
        assert bitwise_equal(torch.softmax(x[:1], -1), torch.softmax(x, -1)[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_against_float64(dtype: torch.dtype) -> None:
    x = randn(9, 1000, seed=3, dtype=dtype, scale=4.0)
    w = torch.linspace(0.5, 1.5, 1000).to(dtype)
    xd, wd = x.double(), w.double()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(bi.sum(x).double(), xd.sum(-1), rtol=1e-5, atol=1e-3 if dtype == torch.float32 else 1.0)
    torch.testing.assert_close(bi.mean(x).double(), xd.mean(-1), **tol)
    torch.testing.assert_close(bi.softmax(x).double(), torch.softmax(xd, -1), **tol)
    torch.testing.assert_close(bi.log_softmax(x).double(), torch.log_softmax(xd, -1), **tol)
    torch.testing.assert_close(bi.rms_norm(x, w).double(), torch.nn.functional.rms_norm(xd, (1000,), wd, 1e-6), **tol)
    assert bi.softmax(x).dtype == dtype


def test_special_values() -> None:
    x = torch.tensor([[float("-inf"), 0.0, 1.0], [-0.0, -0.0, -0.0]])
    torch.testing.assert_close(bi.softmax(x)[0], torch.softmax(x, -1)[0])  # -inf gets exactly 0
    assert bi.softmax(x)[0, 0].item() == 0.0
    assert str(bi.sum(x[1:]).item()) == "-0.0"  # padding with -0.0 keeps an all -0.0 row at -0.0


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"dim=3 is out of range .*\(2, 3\)"):
        bi.sum(torch.randn(2, 3), dim=3)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        bi.rms_norm(torch.randn(2, 3), torch.ones(4))
