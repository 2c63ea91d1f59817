"""AdamW with fp32 master weights and a warmup + cosine learning-rate schedule.

Guarantee: the update of a parameter element depends only on that element's own history
(gradient, moments, value) and on the step's learning rate, which is a pure function of the step.
AdamW is elementwise, so sharding a parameter across ranks (FSDP2) or not cannot change its bits;
tests/trainer/test_optim.py checks that for torch's implementation on this machine, including
shards that split SIMD vectors at odd offsets. The implementation is pinned (`foreach=False`,
`fused=False`) so that the kernel family never changes with the number or size of tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


@dataclass
class ScheduleConfig:
    warmup_steps: int = 10
    decay_steps: int | None = None  # cosine decay length after warmup; None: the run's step count
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def build_optimizer(params, config: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
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
