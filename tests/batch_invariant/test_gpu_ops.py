"""The Triton backend on a real GPU (marker `gpu`, skipped without CUDA): the interpreter tests'
properties with compiled kernels at LLM-like sizes, bitwise.

mm / linear (bfloat16, float16, float32; a transposed weight; gemm orders v1 and v2): a row alone has the bits it has in
a batch of 1024 rows; bmm likewise; softmax, log_softmax, rms_norm, sum: a row alone == in a
batch; attention (bfloat16, GQA, head_dim 128, several 512-key splits): causal prefill == chunked
prefill into a paged cache == decode steps from it; backward deterministic with a row-invariant
dq; the override mode routes CUDA mm / softmax to the Triton kernels; results match float64.
Negative control: another K tile gives other bits. Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch
from batch_invariant._triton import close

import titan_audit.batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal

pytestmark = pytest.mark.gpu
DEV = "cuda"


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_mm_row_alone_equals_row_in_batch(dtype: torch.dtype, order: str) -> None:
    with bi.gemm_order(order):
        _mm_row_checks(dtype)


def _mm_row_checks(dtype: torch.dtype) -> None:
    x, w = randn(1024, 1024, seed=1, dtype=dtype), randn(768, 1024, seed=2, dtype=dtype)
    full = bi.linear(x, w)
    for i in (0, 77, 1023):
        assert_bitwise_equal(bi.linear(x[i : i + 1], w), full[i : i + 1])
    assert_bitwise_equal(bi.linear(x[100:300], w), full[100:300])
    assert_bitwise_equal(bi.matmul(x[5:9], w.t().contiguous()), full[5:9])
    close(full.cpu(), (x.double() @ w.double().t()).cpu(), dtype)
    a, b = randn(4, 300, 256, seed=3, dtype=dtype), randn(4, 256, 200, seed=4, dtype=dtype)
    assert_bitwise_equal(bi.bmm(a[2:3, 7:8], b[2:3]), bi.bmm(a, b)[2:3, 7:8])


def test_gpu_negative_control_other_k_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_audit.batch_invariant.gpu import matmul

    x, w = randn(256, 1024, seed=5), randn(256, 1024, seed=6)
    one = bi.linear(x, w)
    monkeypatch.setitem(matmul.CONFIGS, torch.float32, (64, 64, 16, 4, 3))
    assert not bitwise_equal(one, bi.linear(x, w))


def test_gpu_row_ops_row_alone_equals_row_in_batch() -> None:
    x, w = randn(512, 5000, seed=7, dtype=torch.bfloat16), randn(5000, seed=8, dtype=torch.bfloat16)
    ops = {
        "sum": lambda t: bi.sum(t, -1),
        "softmax": lambda t: bi.softmax(t, -1),
        "log_softmax": lambda t: bi.log_softmax(t, -1),
        "rms_norm": lambda t: bi.rms_norm(t, w, 1e-6),
    }
    for name, op in ops.items():
        full = op(x)
        for i in (0, 300):
            assert_bitwise_equal(op(x[i : i + 1]), full[i : i + 1], name)
    close(bi.softmax(x, -1).cpu(), torch.softmax(x.double(), -1).cpu(), torch.bfloat16)


def test_gpu_attention_prefill_equals_chunked_paged_equals_decode() -> None:
    from titan_audit.batch_invariant import backend

    b, hq, hkv, t, d, page = 2, 8, 2, 1500, 128, 16
    q = randn(b, hq, t, d, seed=10, dtype=torch.bfloat16)
    k = randn(b, hkv, t, d, seed=11, dtype=torch.bfloat16)
    v = randn(b, hkv, t, d, seed=12, dtype=torch.bfloat16)
    positions = torch.arange(t, device=DEV).expand(b, t)
    full = bi.attention(q, k, v)
    be = backend.backend_for(q)
    pages = -(-t // page)
    order = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0)).to(DEV)
    table = order.reshape(b, pages).to(torch.int32)
    kc = torch.full((b * pages, hkv, page, d), float("nan"), device=DEV, dtype=torch.bfloat16)
    vc = kc.clone()
    j = torch.arange(t, device=DEV)
    for s in range(b):
        kc[table[s, j // page].long(), :, j % page] = k[s].transpose(0, 1)
        vc[table[s, j // page].long(), :, j % page] = v[s].transpose(0, 1)
    pieces = []
    bounds = [0, 300, 777, 1400, t - 3, t - 2, t - 1, t]  # chunks, then three decode steps
    for lo, hi in zip(bounds, bounds[1:]):
        lens = torch.full((b,), hi, dtype=torch.int32, device=DEV)  # keys past hi hold real data: unseen
        out, _ = be.paged_attention(q[:, :, lo:hi], kc, vc, table, lens, positions[:, lo:hi], d**-0.5)
        pieces.append(out.to(torch.bfloat16))
    assert_bitwise_equal(torch.cat(pieces, dim=2), full)
    assert_bitwise_equal(bi.attention(q[1:, :, :999], k[1:, :, :999], v[1:, :, :999]), full[1:, :, :999])


def test_gpu_attention_backward_deterministic_and_row_invariant() -> None:
    b, hq, hkv, t, d = 2, 4, 2, 700, 64
    q, k, v = (randn(b, h, t, d, seed=20 + i, dtype=torch.bfloat16) for i, h in enumerate((hq, hkv, hkv)))
    g = randn(b, hq, t, d, seed=30, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        bi.attention(qq, kk, vv).backward(g)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, c in zip(*grads):
        assert_bitwise_equal(a, c)
    qq = q[:1, :, 500:501].clone().requires_grad_()
    bi.attention(qq, k[:1], v[:1], q_positions=torch.arange(500, 501)).backward(g[:1, :, 500:501])
    assert_bitwise_equal(qq.grad, grads[0][0][:1, :, 500:501])


def test_gpu_mode_routes_cuda_ops_to_triton() -> None:
    x, w = randn(64, 512, seed=40, dtype=torch.bfloat16), randn(256, 512, seed=41, dtype=torch.bfloat16)
    direct = bi.linear(x, w)
    with bi.enabled():
        assert_bitwise_equal(torch.nn.functional.linear(x, w), direct)
        assert_bitwise_equal(torch.softmax(direct, -1), bi.softmax(direct, -1))


def test_gpu_mode_sdpa_runs_our_attention_forward_and_backward() -> None:
    import torch.nn.functional as F

    q, k, v = (randn(2, 8, 300, 64, seed=50 + i, dtype=torch.bfloat16) for i in range(3))
    g = randn(2, 8, 300, 64, seed=60, dtype=torch.bfloat16)
    want = bi.attention(q, k, v)
    grads = []
    with bi.enabled():
        for _ in range(2):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            assert_bitwise_equal(out, want)
            out.backward(g)
            grads.append((qq.grad, kk.grad, vv.grad))
    for a, c in zip(*grads):
        assert_bitwise_equal(a, c)
