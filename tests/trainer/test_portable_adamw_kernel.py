"""PortableAdamW's fused kernel (batch_invariant/cpu/optim.py, kernels/optim.cpp) writes the bits of
its torch-op path (the reference, `fused_kernel = False`), raw bits compared.

Proves: over several steps, on every ISA variant this CPU runs and at 1 and 2 threads, with sizes
0, 1, odd lengths around the vector widths and ones the threads split, weight decay on and off,
values over the whole float32 range (zeros of both signs, subnormals, values whose squares overflow
or underflow, negatives), the parameter and both moments are bit-identical to the torch path; a
gradient of +-inf gives the same bits (the invalid division's NaN). DTensor parameters (FSDP2 / TP)
take the kernel on their local shards with the same bits; tensors it cannot take (bf16,
non-contiguous) stay on the torch path. Negative controls: the same comparison fails for a
reference with eps one ulp larger, and for one with the weight decay applied after the update
(the ops reordered).
"""

from __future__ import annotations

import math

import pytest
import torch

from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu import optim as fused
from titan_audit.trainer import optim
from titan_audit.trainer.optim import PortableAdamW

SIZES = (0, 1, 7, 15, 16, 17, 33, 1023, 100003)  # 100003 >= the kernel's parallel threshold
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}


def _wide(n: int, g: torch.Generator) -> torch.Tensor:
    """float32 values spread over every binade (subnormals to ~1e38), both signs, some zeros."""
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-150, 124, (n,), generator=g).double()
    )
    x = x.float()
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    x[torch.rand(n, generator=g) < 0.05] = -0.0
    return x


def _bits(opt: PortableAdamW, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    out = []
    for p in params:
        out += [p.detach().view(torch.int32).clone()]
        out += [opt.state[p]["exp_avg"].view(torch.int32).clone(), opt.state[p]["exp_avg_sq"].view(torch.int32).clone()]
    return out


def _run(kernel: bool, sizes, weight_decay: float, steps: int = 4, seed: int = 0, grad_fn=None):
    g = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.where(torch.rand(n, generator=g) < 0.5, _wide(n, g), torch.randn(n, generator=g)))
        for n in sizes
    ]
    opt = PortableAdamW(params, weight_decay=weight_decay, foreach=False, fused=False, **HYPER)
    opt.fused_kernel = kernel
    for step in range(steps):
        for p in params:
            grad = _wide(p.numel(), g) if step % 2 == 0 else torch.randn(p.numel(), generator=g) * 1e-3
            p.grad = grad if grad_fn is None else grad_fn(step, grad)
        opt.step()
    return _bits(opt, params)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def isa(request):
    if request.param not in _lib.available_isas():
        pytest.skip(f"this CPU cannot run the {request.param} variant")
    with _lib.forced_isa(request.param):
        yield request.param


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("weight_decay", [0.1, 0.0], ids=["wd", "no_wd"])
def test_fused_step_equals_the_torch_path_bitwise(isa, threads, weight_decay):
    reference = _run(False, SIZES, weight_decay)
    assert _equal(_run(True, SIZES, weight_decay), reference), f"{isa}, {threads} threads"
    assert reference[-2].ne(0).sum() > 90000 and reference[-1].ne(0).sum() > 90000, "the moments were updated"


def test_infinite_gradients_give_the_same_bits(isa):
    def with_inf(step: int, grad: torch.Tensor) -> torch.Tensor:
        if step == 0 and grad.numel() >= 4:
            grad[1], grad[3] = math.inf, -math.inf
        return grad

    a = _run(True, (17, 1023), 0.1, steps=1, grad_fn=with_inf)
    b = _run(False, (17, 1023), 0.1, steps=1, grad_fn=with_inf)
    assert _equal(a, b)
    assert a[0].view(torch.float32)[1].isnan(), "inf / inf: the update is NaN (the test meets the case)"


def test_the_trainer_takes_the_kernel_for_float32_and_torch_for_the_rest(monkeypatch):
    calls = []
    real = fused.adamw_step_
    monkeypatch.setattr(fused, "adamw_step_", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    g = torch.Generator().manual_seed(1)
    dense = torch.nn.Parameter(torch.randn(5, 7, generator=g))
    strided = torch.nn.Parameter(torch.randn(7, 5, generator=g).t())  # not contiguous: torch path
    half = torch.nn.Parameter(torch.randn(9, generator=g).bfloat16())  # bf16: torch path
    params = [dense, strided, half]
    opt = PortableAdamW(params, weight_decay=0.1, foreach=False, fused=False, **HYPER)
    ref = PortableAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], weight_decay=0.1, **HYPER)
    ref.fused_kernel = False
    for _ in range(2):
        for p, q in zip(params, ref.param_groups[0]["params"], strict=True):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert calls == [torch.Size([5, 7])] * 2, "only the contiguous float32 parameter took the kernel"
    for p, q in zip(params, ref.param_groups[0]["params"], strict=True):
        assert torch.equal(
            p.detach().view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32),
            q.detach().view(torch.int16 if q.dtype == torch.bfloat16 else torch.int32),
        )


def test_fusable_and_its_value_error():
    x = torch.zeros(8)
    assert fused.fusable(x, torch.zeros(8), torch.zeros(8), torch.zeros(8))
    assert not fused.fusable(x, x, torch.zeros(8), torch.zeros(8)), "aliased buffers"
    assert not fused.fusable(x, torch.zeros(4), torch.zeros(8), torch.zeros(8)), "shapes differ"
    assert not fused.fusable(x, torch.zeros(8, dtype=torch.float64), torch.zeros(8), torch.zeros(8))
    assert not fused.fusable(torch.zeros(4, 2).t(), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4))
    kw = {"decay": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "bias_correction2_sqrt": 1.0, "step_size": -1.0}
    with pytest.raises(ValueError, match="adamw_step_"):
        fused.adamw_step_(x, x, torch.zeros(8), torch.zeros(8), **kw)


_TORCH_UPDATE = optim._update_torch


def _update_eps_ulp(p, grad, exp_avg, exp_avg_sq, *, eps, **kw):
    """eps one float32 ulp larger (eps is rounded to float32 in the ops)."""
    eps32 = torch.tensor(eps, dtype=torch.float32)
    _TORCH_UPDATE(p, grad, exp_avg, exp_avg_sq, eps=float(torch.nextafter(eps32, eps32 * 2)), **kw)


def _update_decay_last(p, grad, exp_avg, exp_avg_sq, *, lr, weight_decay, **kw):
    """The weight decay after the Adam update instead of before it."""
    _TORCH_UPDATE(p, grad, exp_avg, exp_avg_sq, lr=lr, weight_decay=0.0, **kw)
    p.mul_(1 - lr * weight_decay)


@pytest.mark.control
@pytest.mark.parametrize("variant", [_update_eps_ulp, _update_decay_last], ids=["eps_plus_1ulp", "decay_reordered"])
def test_negative_control_a_changed_reference_differs(monkeypatch, variant):
    def near_eps(step: int, grad: torch.Tensor) -> torch.Tensor:  # sqrt(v) about eps: eps counts
        return torch.randn(grad.shape, generator=torch.Generator().manual_seed(step)) * 1e-8

    sizes = (17, 1023)
    fused_bits = _run(True, sizes, 0.1, grad_fn=near_eps)
    assert _equal(fused_bits, _run(False, sizes, 0.1, grad_fn=near_eps))
    monkeypatch.setattr(optim, "_update_torch", variant)
    assert not _equal(fused_bits, _run(False, sizes, 0.1, grad_fn=near_eps))


def test_dtensor_shards_take_the_kernel_with_the_torch_paths_bits(tmp_path, monkeypatch):
    """FSDP2 / TP parameters are DTensors: the kernel updates their local shards in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    own_group = not dist.is_initialized()  # a group an earlier test left is reused, never skipped
    assert own_group or dist.get_world_size() == 1, "needs a 1-rank process group"
    calls = []
    real = fused.adamw_step_
    monkeypatch.setattr(fused, "adamw_step_", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(2)
        value, grads = _wide(1023, g), [_wide(1023, g) for _ in range(3)]
        out = []
        for kernel in (True, False):
            p = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, [Shard(0)]))
            opt = PortableAdamW([p], weight_decay=0.1, foreach=False, fused=False, **HYPER)
            opt.fused_kernel = kernel
            for grad in grads:
                p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
                opt.step()
            assert isinstance(p.data, DTensor) and isinstance(opt.state[p]["exp_avg"], DTensor)
            out.append(
                [p.detach().to_local(), opt.state[p]["exp_avg"].to_local(), opt.state[p]["exp_avg_sq"].to_local()]
            )
        assert calls == [torch.Size([1023])] * 3, "the DTensor parameter took the kernel"
        assert _equal([t.view(torch.int32) for t in out[0]], [t.view(torch.int32) for t in out[1]])
    finally:
        if own_group:
            dist.destroy_process_group()
