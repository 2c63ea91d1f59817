"""The override mode: state, nesting, exceptions, re-entry, and invariance of unmodified code.

Proves: `is_enabled()` is exactly whether overrides are installed (checked by the bits `x @ w`
produces, not by the flag: under the overrides it follows the gemm order); nested `enabled()`
blocks, an inner `enabled(False)`, exceptions inside blocks and enable()/disable() calls leave
the state right, including the public library's bug (an inner exit dropping the outer block's
overrides while the flag reads True); kernels never re-enter the mode; plain
`torch.nn.functional` calls (linear, matmul, softmax, log_softmax, sum, mean, rms_norm, SDPA) and
a small nn.Module become row-invariant, property-tested, with the same bits as the functional API;
a CUDA tensor raises a clear error. Negative control: in the mode, a sample run alone in another
gemm order gives other bits than in the batch.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from batch_invariant._helpers import num_threads, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.backend import backend_for
from titan_audit.deterministic import fingerprint

X = randn(8, 1024, seed=1)
W = randn(1024, 1024, seed=2)


def overrides_active() -> bool:
    """Observe the overrides by their effect: under them `x @ w` runs our gemm, which sums K = 1024
    in the process's gemm order (v1: one chain, v2: a tree of 16 blocks), so the two orders give
    other bits; a native `x @ w` does not read the order and gives the same bits twice."""
    with num_threads(1):
        with bi.gemm_order("v1"):
            v1 = X[:1] @ W
        with bi.gemm_order("v2"):
            v2 = X[:1] @ W
        return not bitwise_equal(v1, v2)


@pytest.fixture(autouse=True)
def _mode_off():
    bi.disable()
    yield
    bi.disable()


def test_observable_state_matches_flag() -> None:
    assert not bi.is_enabled() and not overrides_active()
    bi.enable()
    assert bi.is_enabled() and overrides_active()
    bi.enable()  # idempotent
    assert bi.is_enabled()
    bi.disable()
    assert not bi.is_enabled() and not overrides_active()
    bi.disable()
    assert not bi.is_enabled()


def test_nesting_inner_exit_keeps_outer_overrides() -> None:
    with bi.enabled():
        with bi.enabled():
            assert bi.is_enabled() and overrides_active()
        # The public library's bug: here the overrides were gone while the flag read True.
        assert bi.is_enabled() and overrides_active()
        with bi.enabled(False):
            assert not bi.is_enabled() and not overrides_active()
        assert bi.is_enabled() and overrides_active()
    assert not bi.is_enabled() and not overrides_active()


def test_exceptions_restore_state() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with bi.enabled():
            with pytest.raises(KeyError):
                with bi.enabled():
                    raise KeyError("inner")
            assert bi.is_enabled() and overrides_active()
            raise RuntimeError("boom")
    assert not bi.is_enabled() and not overrides_active()
    bi.enable()
    with pytest.raises(ValueError):
        with bi.enabled(False):
            raise ValueError("x")
    assert bi.is_enabled() and overrides_active()


def test_fingerprint_reads_the_mode() -> None:
    assert fingerprint().batch_invariant is False
    with bi.enabled():
        assert fingerprint().batch_invariant is True
    assert fingerprint().batch_invariant is False


def test_reentry_mode_matches_functional_api() -> None:
    """Inside the mode the kernels call native gemms without recursing; same bits as the ops."""
    x, w, b = randn(5, 64, seed=3), randn(48, 64, seed=4), randn(48, seed=5)
    q, k, v = (randn(2, 4, 70, 16, seed=s) for s in (6, 7, 8))
    expected = [bi.linear(x, w, b), bi.log_softmax(x), bi.softmax(x), bi.rms_norm(x, eps=1e-6), bi.matmul(x, w.t())]
    with bi.enabled():
        got = [F.linear(x, w, b), F.log_softmax(x, -1), F.softmax(x, -1), F.rms_norm(x, (64,), eps=1e-6), x @ w.t()]
        for a, e in zip(got, expected):
            assert_bitwise_equal(a, e)
        assert_bitwise_equal(bi.linear(x, w, b), expected[0], "functional op inside the mode")
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # SDPA's causal mask is top-left aligned; with Tq == Tk it is the default of bi.attention.
    assert_bitwise_equal(sdpa, bi.attention(q, k, v))


class TinyBlock(torch.nn.Module):
    """A pre-norm attention + MLP block written in plain torch, unaware of batch invariance."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(a)
        return F.log_softmax(x + self.down(F.gelu(self.up(self.norm(x)))), dim=-1)


@settings(max_examples=200)
@given(batch=st.integers(1, 24), t=st.integers(1, 80), j=st.data())
def test_module_samples_are_batch_invariant_in_mode(batch: int, t: int, j: st.DataObject) -> None:
    torch.manual_seed(0)
    block = TinyBlock()
    x = randn(batch, t, 32, seed=batch * 1000 + t)
    i = j.draw(st.integers(0, batch - 1), label="sample")
    with torch.no_grad(), bi.enabled():
        assert_bitwise_equal(block(x[i : i + 1]), block(x)[i : i + 1])
        assert_bitwise_equal(
            F.linear(x[i], block.up.weight, block.up.bias), F.linear(x, block.up.weight, block.up.bias)[i]
        )
        assert_bitwise_equal(x[i : i + 1].sum(-1), x.sum(-1)[i : i + 1])
        assert_bitwise_equal(x[i : i + 1].mean(dim=(1, 2)), x.mean(dim=(1, 2))[i : i + 1])


@pytest.mark.control
def test_negative_control_a_sample_alone_in_another_gemm_order_differs() -> None:
    """The module check can fail: in the mode, each sample run alone in gemm order v1 gives other
    bits than the batch run in v2 (the default), under the comparison the mode passes. The module
    without the mode is reported, not asserted: whether native ops keep a sample's bits alone
    depends on the CPU."""
    samples = (0, 5, 10, 15)
    torch.manual_seed(0)
    block = TinyBlock(dim=256, heads=4)
    x = randn(16, 3, 256, seed=9)
    with torch.no_grad(), num_threads(2):
        with bi.enabled():
            full = block(x)
            for i in samples:
                assert_bitwise_equal(block(x[i : i + 1]), full[i : i + 1])
        with bi.enabled(gemm_order="v1"):
            for i in samples:
                assert not bitwise_equal(block(x[i : i + 1]), full[i : i + 1]), f"sample {i}"
        native = block(x)
        differ = sum(not bitwise_equal(block(x[i : i + 1]), native[i : i + 1]) for i in samples)
        print(f"without the mode: {differ} of {len(samples)} samples differ alone")


def test_integer_sum_in_mode_stays_native() -> None:
    x = torch.arange(12).reshape(3, 4)
    with bi.enabled():
        assert x.sum(-1).tolist() == [6, 22, 38]
        assert x.sum(dim=(0, 1)).item() == 66


def test_cuda_tensor_gets_the_triton_backend() -> None:
    """A CUDA tensor selects the Triton backend (issue 16); without Triton, a clear error."""
    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    try:
        import triton  # noqa: F401
    except ImportError:
        with pytest.raises(NotImplementedError, match="CUDA backend needs Triton"):
            backend_for(fake)  # type: ignore[arg-type]
    else:
        assert backend_for(fake).NAME == "triton"  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="no backend for device type 'meta'"):
        bi.mm(torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta"))


def test_mode_claims_cuda_ops_so_they_cannot_fall_back() -> None:
    """No CUDA here, so check the registration itself: in the mode, the CUDA kernels of the
    overridden ops (and CUDA's SDPA kernels) are ours, and ours raise for CUDA tensors."""

    def cuda_kernel_is_ours(op: str) -> bool:
        dump = torch._C._dispatch_dump(op)
        return any(line.startswith("CUDA:") and "batch_invariant/mode.py" in line for line in dump.splitlines())

    ops = ["aten::mm", "aten::addmm", "aten::bmm", "aten::_log_softmax", "aten::_scaled_dot_product_flash_attention"]
    assert not any(cuda_kernel_is_ours(op) for op in ops)
    with bi.enabled():
        assert all(cuda_kernel_is_ours(op) for op in ops)
    assert not any(cuda_kernel_is_ours(op) for op in ops)
