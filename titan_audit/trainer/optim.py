"""AdamW with fp32 master weights and a warmup + cosine learning-rate schedule.

Guarantee: the update of a parameter element depends only on that element's own history
(gradient, moments, value) and on the step's learning rate, which is a pure function of the step.
AdamW is elementwise, so sharding a parameter across ranks (FSDP2) or not cannot change its bits;
tests/trainer/test_optim.py checks that for torch's implementation on this machine, including
shards that split SIMD vectors at odd offsets. The implementation is pinned (`foreach=False`,
`fused=False`) so that the kernel family never changes with the number or size of tensors.

`PortableAdamW` (used when `determinism.batch_invariant` is on) computes the same update with
separate multiplies, adds, divides and square roots only: each is correctly rounded on every CPU
and ISA, so the update's bits do not depend on the CPU. The square root is the backend's kernel
(`batch_invariant.cpu.pointwise.sqrt` on CPU, Triton's `sqrt_rn` on CUDA): torch.sqrt on a CPU
tensor runs MKL's VML, which picks its code path by CPU vendor (1 ulp off on ~17% of inputs on
an AMD EPYC, ~0.6% on an AVX-512 Xeon; tests/batch_invariant/test_census.py keeps the control
against the correctly rounded root).
Torch's own AdamW uses `lerp_`, `addcmul_` and `addcdiv_`, whose vector kernels fuse multiply-adds
on AVX2/AVX-512 and not in the default (scalar) build, so its bits change with `ATEN_CPU_CAPABILITY`
(tested). For float32 contiguous CPU parameters (DTensors: their local shards) the update runs as
one fused pass over memory (`batch_invariant.cpu.optim`, kernels/optim.cpp: the same IEEE float32
operations in the same order, each scalar rounded to float32 as torch rounds it, so the same bits;
tests/trainer/test_portable_adamw_kernel.py compares them with the torch-op path, which stays the
path for everything else). Its state dict has torch's layout (`step`, `exp_avg`, `exp_avg_sq`),
so checkpoints load either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.cpu import optim as fused


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    betas: tuple[float, ...] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.grad_clip < 0:
            raise ValueError(f"optimizer.grad_clip must be >= 0, got {self.grad_clip}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr * self.weight_decay >= 1:  # p *= 1 - lr*wd: would flip or zero every weight
            raise ValueError(f"optimizer.lr * optimizer.weight_decay must be < 1, got {self.lr} * {self.weight_decay}")


@dataclass
class ScheduleConfig:
    warmup_steps: int = 10
    decay_steps: int | None = None  # cosine decay length after warmup; None: the run's step count
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"schedule.decay_steps must be >= 1 (or unset: the run's steps), got {self.decay_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def _portable_sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE sqrt by the batch-invariant backend's kernel (CPU: ours, as torch.sqrt may run MKL
    VML, whose bits follow the CPU vendor; CUDA: Triton's `sqrt_rn`); a DTensor (FSDP2 shard)
    elementwise on its local shard. float64 off the CPU: torch's sqrt (correctly rounded on CUDA)."""
    if isinstance(x, DTensor):
        local = _portable_sqrt(x.to_local())
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    backend = backend_for(x)
    if x.dtype == torch.float64 and "sqrt" not in backend.FLOAT64_POINTWISE:
        return x.sqrt()
    return backend.sqrt(x).to(x.dtype)


def _update_torch(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """PortableAdamW's update of one parameter as torch ops (any dtype, layout, device, DTensor)."""
    decay, bias_correction2_sqrt, step_size = _step_scalars(lr, beta1, beta2, weight_decay, step)
    p.mul_(decay)
    exp_avg.mul_(beta1).add_(grad * (1 - beta1))
    exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))
    denom = _portable_sqrt(exp_avg_sq).div_(bias_correction2_sqrt).add_(eps)
    p.add_(exp_avg.div(denom).mul_(step_size))


def _step_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, ...]:
    """(1 - lr*wd, sqrt(1 - beta2^t), -lr / (1 - beta1^t)): the Python scalars both update paths
    use, computed once here so the kernel's and the torch ops' scalars are the same doubles."""
    return 1 - lr * weight_decay, math.sqrt(1 - beta2**step), -lr / (1 - beta1**step)


def _update_fused(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> bool:
    """The same update by the fused kernel (`batch_invariant.cpu.optim`, the same bits) when the
    operands qualify (float32, contiguous, CPU; DTensors of one mesh and placements by their local
    shards: the update is elementwise, so the torch path's DTensor ops are those local ops).
    Returns False, having done nothing, when they do not."""
    tensors = (p, grad, exp_avg, exp_avg_sq)
    if isinstance(p, DTensor):
        if not all(isinstance(t, DTensor) for t in tensors):
            return False
        if any(t.device_mesh != p.device_mesh or t.placements != p.placements for t in tensors):
            return False
        local = tuple(t.to_local() for t in tensors)
    elif any(isinstance(t, DTensor) for t in tensors):
        return False
    else:
        local = tensors
    if not fused.fusable(*local):
        return False
    decay, bias_correction2_sqrt, step_size = _step_scalars(lr, beta1, beta2, weight_decay, step)
    fused.adamw_step_(
        *local,
        decay=decay,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        bias_correction2_sqrt=bias_correction2_sqrt,
        step_size=step_size,
    )
    if local is not tensors:  # the DTensors were written in place too
        for t in (p, exp_avg, exp_avg_sq):
            torch.autograd.graph.increment_version(t)
    return True


class PortableAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay) whose bits are the same on every CPU: see the module doc.
    Order per element: p *= 1 - lr*wd; m = m*b1 + g*(1-b1); v = v*b2 + (g*g)*(1-b2);
    p += (m / (sqrt(v) / sqrt(1-b2^t) + eps)) * (-lr / (1-b1^t)).
    `fused_kernel` (default True; False: torch ops only, the reference the kernel is tested against)."""

    fused_kernel: bool = True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        assert closure is None, "PortableAdamW.step takes no closure"
        for group in self.param_groups:
            assert not group["amsgrad"] and not group["maximize"], "PortableAdamW: amsgrad/maximize unsupported"
            beta1, beta2 = group["betas"]
            hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"]}
            hyper["weight_decay"] = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                operands = (p, grad, state["exp_avg"], state["exp_avg_sq"])
                if not (self.fused_kernel and _update_fused(*operands, **hyper, step=step)):
                    _update_torch(*operands, **hyper, step=step)
        return None


def build_optimizer(params, config: OptimizerConfig, *, portable: bool = False) -> torch.optim.AdamW:
    """torch's AdamW, or with `portable` the CPU-independent `PortableAdamW` (same hyper-parameters)."""
    return (PortableAdamW if portable else torch.optim.AdamW)(
        params,
        lr=config.lr,
        betas=(config.betas[0], config.betas[1]),
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
        fused=False,
    )


def lr_at(step: int, optimizer: OptimizerConfig, schedule: ScheduleConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    peak = optimizer.lr
    if step < schedule.warmup_steps:
        return peak * (step + 1) / schedule.warmup_steps
    decay = schedule.decay_steps if schedule.decay_steps is not None else max(total_steps - schedule.warmup_steps, 1)
    progress = min((step - schedule.warmup_steps) / decay, 1.0)
    floor = peak * schedule.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
