"""An RL step's metrics row, from per-group figures gathered in prompt order.

    stats = group_stats(samples, reward, gen_lp, loss, parts)    # float64 [len(STATS)], one group
    row = metrics_row(step, stats_V, ratios_V, lr, grad_norm, version, world_size)

Guarantee: every figure is a sum over the V groups' rows in prompt order (then divided by the
step's sample or token count), so the row does not depend on W.
"""

from __future__ import annotations

import torch

from titan_audit.rl.generator import Sample
from titan_audit.rl.loss import combine_gap

STATS = ("samples", "reward_sum", "reward_sq_sum", "exact", "stopped", "tokens", "loss", "pg", "clipped", "ref_kl")


def group_stats(samples: list[Sample], reward: torch.Tensor, gen_lp: torch.Tensor, loss: torch.Tensor, parts: dict):
    """One group's STATS row (float64)."""
    return torch.tensor(
        [
            len(samples),
            float(reward.double().sum()),
            float(reward.double().square().sum()),
            float((reward == 1.0).sum()),
            sum(s.finish_reason == "stop" for s in samples),
            len(gen_lp),
            float(loss.detach()),
            parts["pg"],
            parts["clipped"],
            parts["ref_kl"],
        ],
        dtype=torch.float64,
    )


def metrics_row(
    step: int, stats: torch.Tensor, ratios: torch.Tensor, lr: float, grad_norm: float, version: int, world_size: int
) -> dict:
    s = dict(zip(STATS, stats.sum(dim=0).tolist()))
    n = max(s["samples"], 1.0)
    mean = s["reward_sum"] / n
    tokens = max(s["tokens"], 1.0)
    return {
        "step": step,
        "loss": s["loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        "reward_mean": mean,
        "reward_std": max(s["reward_sq_sum"] / n - mean * mean, 0.0) ** 0.5,
        "exact_fraction": s["exact"] / n,
        "stop_fraction": s["stopped"] / n,
        "tokens": int(s["tokens"]),
        "completion_length": s["tokens"] / n,
        "pg_mean": s["pg"] / tokens,
        "clip_fraction": s["clipped"] / tokens,
        "ref_kl": s["ref_kl"] / tokens,
        **combine_gap(ratios, "ratio"),
        "policy_version": version,
        "policy_age": step - 1 - version,
        "world_size": world_size,
    }
