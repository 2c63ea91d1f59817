"""The fused inference ops (`batch_invariant.add_rms_norm`, `rms_norm_rope`, `silu_mul`; the last
also has a backward, tested in test_training_fusions.py) and `models.ops`' use of them.

Proves: each fused kernel gives, bitwise, the bits of the ops it replaces (h + delta then rms_norm
with the weight; rms_norm, the weight and `apply_rope`; silu then one multiply) on every ISA
variant and thread count, for strided views read in place (the halves of one fused gate/up
matrix, q's and k's heads of one projection), row by row whatever the batch; add_rms_norm
refuses autograd; `models.ops` takes the fused add + norm only for float32 BI inference and the
composition otherwise (so training keeps its graph). Negative control: the composition in another
order or rounding (the norm's sum of squares over each row reversed; silu as gate * sigmoid(gate))
differs from the fused kernel's bits, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.batch_invariant._helpers import num_threads, randn
from titan_audit import batch_invariant as bi
from titan_audit.audit.bitwise import assert_bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.models import ops
from titan_audit.models.rope import apply_rope

SHAPES = [(1, 1), (3, 7), (8, 256), (5, 1023), (40, 1000)]  # odd rows hit every vector tail; 40 x 1000 splits


def _inputs(m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, delta = randn(m, n, seed=seed, scale=3.0), randn(m, n, seed=seed + 1)
    weight = torch.rand(n, generator=torch.Generator().manual_seed(seed + 2)) + 0.5
    gate_up = randn(m, 2 * n, seed=seed + 3, scale=10.0)
    return h, delta, weight, gate_up


def _composed(h, delta, weight, gate_up):  # noqa: ANN001, ANN202
    n = h.shape[-1]
    s = h + delta  # the norm without weight, then the multiply: not the fused kernels' own paths
    return s, weight * bi.rms_norm(s, None, 1e-6), ops.silu(gate_up[:, :n]) * gate_up[:, n:]


@pytest.mark.parametrize(("m", "n"), SHAPES)
def test_fused_ops_are_bitwise_their_compositions_on_every_variant_and_thread_count(m: int, n: int) -> None:
    h, delta, weight, gate_up = _inputs(m, n, seed=m * 1000 + n)
    with torch.no_grad(), bi.enabled():
        s_ref, y_ref, swiglu_ref = _composed(h, delta, weight, gate_up)
        for isa in _lib.available_isas():
            for threads in (1, 2):
                with _lib.forced_isa(isa), num_threads(threads):
                    s, y = bi.add_rms_norm(h, delta, weight, 1e-6)
                    swiglu = bi.silu_mul(gate_up[:, :n], gate_up[:, n:])  # the halves, read in place
                what = f"{isa}, {threads} threads, [{m}, {n}]"
                assert_bitwise_equal(s, s_ref, f"add_rms_norm sum, {what}")
                assert_bitwise_equal(y, y_ref, f"add_rms_norm norm, {what}")
                assert_bitwise_equal(swiglu, swiglu_ref, f"silu_mul, {what}")


@pytest.mark.parametrize(("tokens", "heads", "d"), [(1, 1, 2), (3, 6, 64), (8, 6, 128), (5, 3, 10)])
def test_rms_norm_rope_is_bitwise_norm_weight_and_rope_on_every_variant(tokens: int, heads: int, d: int) -> None:
    qkv = randn(tokens, heads + 2, d, seed=tokens * 100 + d, scale=4.0)
    x = qkv[:, :heads]  # q's and k's heads of one projection: a strided view
    weight_Hd = torch.rand(heads, d, generator=torch.Generator().manual_seed(d)) + 0.5
    cos, sin = randn(tokens, d, seed=1), randn(tokens, d, seed=2)
    with torch.no_grad(), bi.enabled():
        ref = apply_rope(ops.rms_norm(x, weight_Hd, 1e-6)[:, :, None], cos[:, None], sin[:, None])[:, :, 0]
        ref_one = apply_rope(ops.rms_norm(x, weight_Hd[0], 1e-6)[:, :, None], cos[:, None], sin[:, None])[:, :, 0]
        for isa in _lib.available_isas():
            for threads in (1, 2):
                with _lib.forced_isa(isa), num_threads(threads):
                    what = f"{isa}, {threads} threads, x {tuple(x.shape)}"
                    assert_bitwise_equal(bi.rms_norm_rope(x, weight_Hd, cos, sin, 1e-6), ref, what)
                    assert_bitwise_equal(
                        bi.rms_norm_rope(x, weight_Hd[0], cos, sin, 1e-6), ref_one, f"[d] weight, {what}"
                    )
        alone = bi.rms_norm_rope(x[-1:], weight_Hd, cos[-1:], sin[-1:], 1e-6)  # the last token alone
        assert_bitwise_equal(alone[0], ref[-1], "the last token alone vs in the batch")


def test_a_rows_bits_do_not_depend_on_the_batch() -> None:
    h, delta, weight, gate_up = _inputs(9, 256, seed=7)
    with torch.no_grad(), bi.enabled():
        s, y = bi.add_rms_norm(h, delta, weight)
        swiglu = bi.silu_mul(gate_up[:, :256], gate_up[:, 256:])
        for i in (0, 4, 8):
            s_i, y_i = bi.add_rms_norm(h[i : i + 1], delta[i : i + 1], weight)
            assert_bitwise_equal(s_i[0], s[i], f"sum row {i}")
            assert_bitwise_equal(y_i[0], y[i], f"norm row {i}")
            assert_bitwise_equal(bi.silu_mul(gate_up[i : i + 1, :256], gate_up[i : i + 1, 256:])[0], swiglu[i])


@pytest.mark.control
def test_negative_control_compositions_in_another_order_differ() -> None:
    """The fused-vs-composed comparison can fail: the norm with each row's sum of squares taken
    in reverse (the row flipped) and silu as gate * sigmoid(gate) (one rounding more) give other
    bits than the fused kernels. torch's own rms_norm and silu are reported, not asserted: their
    bits depend on the CPU."""
    h, delta, weight, gate_up = _inputs(40, 1000, seed=11)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    with torch.no_grad(), bi.enabled():
        _, y = bi.add_rms_norm(h, delta, weight, 1e-6)
        swiglu = bi.silu_mul(gate, up)
        s = h + delta
        y_reversed = weight * bi.rms_norm(s.flip(-1), None, 1e-6).flip(-1)
        swiglu_other = gate * ops.sigmoid(gate) * up
    with pytest.raises(AssertionError):
        assert_bitwise_equal(y, y_reversed, "add_rms_norm norm")
    with pytest.raises(AssertionError):
        assert_bitwise_equal(swiglu, swiglu_other, "silu_mul")
    y_native = F.rms_norm(h + delta, (1000,), weight, 1e-6)
    swiglu_native = F.silu(gate) * up
    for name, a, b in (("rms_norm", y, y_native), ("silu", swiglu, swiglu_native)):
        print(f"torch's own {name} has the fused bits: {torch.equal(a.view(torch.int32), b.view(torch.int32))}")


def test_fused_ops_refuse_autograd_and_bad_shapes() -> None:
    h, delta, weight, gate_up = _inputs(3, 7, seed=3)
    with bi.enabled():
        with pytest.raises(ValueError, match="forward only"):
            bi.add_rms_norm(h, delta, weight.requires_grad_())
        with pytest.raises(ValueError, match="backward for float32"):  # float32 has one (test_training_fusions)
            bi.silu_mul(gate_up[:, :7].bfloat16().requires_grad_(), gate_up[:, 7:].bfloat16())
        with pytest.raises(ValueError, match="one shape"):
            bi.add_rms_norm(h, delta[:2], weight.detach())
        with pytest.raises(ValueError, match="one shape"):
            bi.silu_mul(gate_up[:, :7], gate_up[:, 8:])
        with pytest.raises(ValueError, match="d even"):
            bi.rms_norm_rope(h[:, None], weight.detach(), h, h)


def test_models_ops_fuse_only_for_bi_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fused = bi.add_rms_norm
    monkeypatch.setattr(bi, "add_rms_norm", lambda *a: calls.append(1) or fused(*a))
    h, delta, weight, _ = _inputs(4, 33, seed=5)
    weight = torch.nn.Parameter(weight)
    with bi.enabled():
        with torch.no_grad():
            s_fused, y_fused = ops.add_rms_norm(h, delta, weight, 1e-6)
        assert len(calls) == 1
        s, y = ops.add_rms_norm(h, delta, weight, 1e-6)  # autograd records: the composition
        assert len(calls) == 1 and y.requires_grad
        y.sum().backward()
        assert weight.grad is not None
    assert_bitwise_equal(s_fused, s.detach(), "sum: fused vs composed")
    assert_bitwise_equal(y_fused, y.detach(), "norm: fused vs composed")
    with torch.no_grad():
        ops.add_rms_norm(h, delta, weight, 1e-6)  # native mode: the composition
    assert len(calls) == 1
