"""The override mode's CUDA SDPA kernels (flash, memory-efficient, cuDNN and their backward),
called here directly on CPU tensors with the Triton backend forced (Triton's interpreter): they
return the outputs the aten schemas promise, match a float64 reference (causal, and an SDPA
attn_mask as a 0/-inf bias, which exercises the kernels' extra_mask path), their backward matches
float64 gradients, and a query row's output is the same alone as in the batch (marker `triton`).
No CUDA is needed: the dispatcher registration itself is checked by test_mode.py, and the same
ops run through F.scaled_dot_product_attention on a GPU in test_gpu_ops.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from batch_invariant._helpers import randn
from batch_invariant._triton import close, triton_on_cpu

from titan_audit.audit import assert_bitwise_equal
from titan_audit.batch_invariant import mode

pytestmark = pytest.mark.triton


def test_cuda_sdpa_overrides_on_the_triton_kernels() -> None:
    b, h, t, d = 1, 2, 20, 16
    q, k, v = (randn(b, h, t, d, seed=s) for s in (1, 2, 3))
    g = randn(b, h, t, d, seed=4)
    keep = torch.rand(t, t, generator=torch.Generator().manual_seed(5)) > 0.3
    keep |= torch.eye(t, dtype=torch.bool)  # every query sees a key
    bias = torch.zeros(t, t).masked_fill(~keep, float("-inf")).expand(b, h, t, t)
    with triton_on_cpu():
        flash = mode._cuda_flash(q, k, v, 0.0, True)
        assert len(flash) == 9 and flash[4] == t and flash[5] == t
        dq, dk, dv = mode._cuda_flash_backward(
            g, q, k, v, flash[0], flash[1], *flash[2:6], 0.0, True, flash[6], flash[7]
        )
        row, *_ = mode._cuda_flash(q[:, :, 7:8], k[:, :, :8], v[:, :, :8], 0.0, False)  # keys 0..7, as row 7 sees
        assert_bitwise_equal(row, flash[0][:, :, 7:8])
        eff = mode._cuda_efficient(q, k, v, bias, True, 0.0, False)
        assert len(eff) == 4
        edq, edk, edv, _ = mode._cuda_efficient_backward(
            g, q, k, v, bias, eff[0], eff[1], eff[2], eff[3], 0.0, [True, True, True, False], False
        )
        cudnn = mode._cuda_cudnn(q, k, v, None, True, 0.0, True)
        assert_bitwise_equal(cudnn[0], flash[0])
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    want.backward(g.double())
    close(flash[0], want, torch.float32)
    for got, ref in zip((dq, dk, dv), (qq.grad, kk.grad, vv.grad)):
        close(got, ref, torch.float32)
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep)
    want.backward(g.double())
    close(eff[0], want, torch.float32)
    for got, ref in zip((edq, edk, edv), (qq.grad, kk.grad, vv.grad)):
        close(got, ref, torch.float32)
