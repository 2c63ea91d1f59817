"""The process-wide gemm order (batch_invariant/order.py): every batch-invariant gemm follows it.

Under v2 (the default) a BI linear / matmul / bmm, its grad_a and grad_b, and the aten override
mode's mm / addmm / bmm give exactly `cpu.matmul.mm(..., blocks=tree_blocks(K))`; under v1 exactly
`blocks=1`. Negative control: for a K the tree splits (K = 768: 8 blocks) the two orders differ in
bits, forward and both gradients. The Triton gemm follows v2 by block partials and the same tree
(interpreter); the numerics fingerprint names the order.
"""

from __future__ import annotations

import pytest
import torch

import titan_audit.batch_invariant as bi
from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant import order
from titan_audit.batch_invariant.cpu import matmul
from titan_audit.deterministic import fingerprint

K = 768  # tree_blocks(768) = 8


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, K, generator=g)
    w = torch.randn(48, K, generator=g)
    dy = torch.randn(5, 48, generator=g)
    return x, w, dy


def _linear_and_grads(x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = bi.linear(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _reference(x, w, dy, order_name: str):
    """The same three products by the kernel with explicit block counts: y = x w^T, dx = dy w, dw = dy^T x."""

    def blocks(k: int) -> int:
        return matmul.tree_blocks(k) if order_name == "v2" else 1

    y = matmul.mm(x, w.t(), blocks=blocks(K))
    dx = matmul.mm(dy, w, blocks=blocks(w.shape[0]))
    dw = matmul.mm(dy.t(), x, blocks=blocks(dy.shape[0]))
    return y, dx, dw


def test_default_order_is_v2_and_the_block_restores_it():
    assert bi.current_gemm_order() == "v2" and matmul.tree_blocks(K) == 8
    with bi.gemm_order("v1"):
        assert bi.current_gemm_order() == "v1" and order.gemm_blocks(K) == 1
        with pytest.raises(RuntimeError), bi.gemm_order("v2"):
            assert order.gemm_blocks(K) == 8
            raise RuntimeError
        assert bi.current_gemm_order() == "v1"
    assert bi.current_gemm_order() == "v2"
    with pytest.raises(ValueError, match="gemm_order must be one of 'v1', 'v2', got 'v3'"):
        bi.set_gemm_order("v3")
    with pytest.raises(ValueError, match="determinism.bi_kernels must be one of"):
        order.check_gemm_order("fast")


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_linear_forward_and_both_grads_follow_the_order(name):
    x, w, dy = _inputs()
    with bi.gemm_order(name):
        got = _linear_and_grads(x, w, dy)
    want = _reference(x, w, dy, name)
    for part, a, b in zip(("y", "grad_x", "grad_w"), got, want):
        assert bitwise_equal(a, b), f"{name}: {part} is not the kernel's {name} result"


@pytest.mark.control
def test_v1_and_v2_differ_in_bits_forward_and_both_grads():
    """Negative control: the order is not a no-op where the tree splits K (768 = 8 x 96)."""
    x, w, dy = _inputs(1)
    # dy has N = 48 columns: grad_x sums over 48 (< 128, one chain in both orders); make N split too
    w2 = torch.randn(256, K, generator=torch.Generator().manual_seed(2))
    dy2 = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    with bi.gemm_order("v1"):
        v1 = _linear_and_grads(x, w2, dy2)
    with bi.gemm_order("v2"):
        v2 = _linear_and_grads(x, w2, dy2)
    for part, a, b in zip(("y", "grad_x", "grad_w"), v1, v2):
        if part == "grad_w":  # its sum runs over the 5 rows: one chain in both orders
            assert bitwise_equal(a, b)
        else:
            assert not bitwise_equal(a, b), f"{part}: v1 and v2 gave the same bits"
    # grad_w splits when the rows do: 256 rows -> 4 blocks of 64
    xs = torch.randn(256, K, generator=torch.Generator().manual_seed(4))
    dys = torch.randn(256, 48, generator=torch.Generator().manual_seed(5))
    with bi.gemm_order("v1"):
        g1 = _linear_and_grads(xs, w, dys)[2]
    with bi.gemm_order("v2"):
        g2 = _linear_and_grads(xs, w, dys)[2]
    assert not bitwise_equal(g1, g2)
    assert bitwise_equal(g2, matmul.mm(dys.t(), xs, blocks=matmul.tree_blocks(256)))


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_override_mode_bmm_and_addmm_follow_the_order(name):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 4, K, generator=g), torch.randn(3, K, 16, generator=g)
    x, w, bias = torch.randn(4, K, generator=g), torch.randn(16, K, generator=g), torch.randn(16, generator=g)
    blocks = matmul.tree_blocks(K) if name == "v2" else 1
    with bi.enabled(gemm_order=name):
        assert bi.current_gemm_order() == name
        got_bmm = a @ b  # aten bmm
        got_addmm = torch.nn.functional.linear(x, w, bias)  # aten addmm
        got_mm = x @ w.t()  # aten mm
    assert bi.current_gemm_order() == "v2"
    assert bitwise_equal(got_bmm, matmul.bmm(a, b, blocks=blocks))
    assert bitwise_equal(got_mm, matmul.mm(x, w.t(), blocks=blocks))
    assert bitwise_equal(got_addmm, matmul.mm(x, w.t(), blocks=blocks) + bias)


def test_the_fingerprint_names_the_order():
    from titan_audit.batch_invariant.cpu import kernel_library

    with bi.enabled(gemm_order="v1"):
        v1 = fingerprint("cpu").bi_kernels
    with bi.enabled(gemm_order="v2"):
        v2 = fingerprint("cpu").bi_kernels
    assert v1 == f"titan-bi-cpu v{kernel_library.KERNELS_VERSION}"  # the string of goldens before v2
    assert v2 == f"titan-bi-cpu v{kernel_library.KERNELS_VERSION} gemm-v2"


@pytest.mark.triton
def test_the_triton_gemm_follows_v2_blocks_tree_and_shards():
    """Under v2 the Triton gemm (interpreter) is the tree of its own v1 block products; the two
    K-halves' results combined by the tree are the whole product (tensor parallelism's rule); a row
    alone gives its bits in the batch. Negative control: v1 differs in bits at this K."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    from titan_audit.batch_invariant import backend

    x, w, _ = _inputs(7)
    bs = K // matmul.tree_blocks(K)
    with backend.forced("triton") as triton_backend:
        v2 = triton_backend.mm(x, w.t())
        halves = [
            triton_backend.mm(x[:, h * K // 2 : (h + 1) * K // 2], w.t()[h * K // 2 : (h + 1) * K // 2]) for h in (0, 1)
        ]
        row = triton_backend.mm(x[3:4], w.t())
        batched = triton_backend.bmm(torch.stack((x, x.flip(0))), torch.stack((w.t(), w.t())))
        with bi.gemm_order("v1"):
            v1 = triton_backend.mm(x, w.t())
            blocks = [triton_backend.mm(x[:, i * bs : (i + 1) * bs], w.t()[i * bs : (i + 1) * bs]) for i in range(8)]
    assert bitwise_equal(v2, matmul.tree_combine(blocks))
    assert bitwise_equal(v2, matmul.tree_combine(halves))
    assert bitwise_equal(row, v2[3:4])
    assert bitwise_equal(batched[0], v2) and bitwise_equal(batched[1], v2.flip(0))
    assert not bitwise_equal(v1, v2)
