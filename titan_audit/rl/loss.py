"""The GRPO-style objective and the zero-gap figures, one prompt group (microbatch) at a time.

    lps = rl.logprobs.sequence_logprobs(model, prompts, completions, temperature)  # trainer side
    adv = group_advantages(rewards, eps)                 # (r - mean) / (std + eps) within the group
    loss, parts = policy_loss(lp, gen_lp, token_adv, global_tokens, clip_eps, ref_lp, kl_coef)
    row = gap_figures(trainer_lp, gen_lp)                # tokens, differing bits, |diff|, k3, ratios
    figures = combine_gap(rows_of_every_group)

All per-token tensors are flat [N]: a group's G completions concatenated in sample order.

Guarantees:
- The loss of a group is  sum over its completion tokens of
      -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + kl_coef * k3_ref
  divided by the step's GLOBAL completion-token count (known to every rank), with
  ratio = exp(trainer_lp - generator_lp) and k3_ref = exp(ref_lp - lp) - (ref_lp - lp) - 1 (the
  k3 estimator of KL(policy || reference) on the policy's samples). The groups' losses summed
  over the fixed tree give the token-mean objective of the whole step, whatever W.
- Advantages are normalised within a group of G samples of one prompt (population std; a group
  whose rewards are all equal gets advantage 0 everywhere).
- Every tensor of a call is on one device (the trainer's); the figures come back there.
- `gap_figures` compares generator and trainer log-probs by raw bits: a token "differs" iff its
  float32 bits differ (so -0.0 vs +0.0 counts); |diff|, k3 and ratios are computed in float64.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - mean) / (std + eps) over one group's rewards [G] (float32, population std)."""
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean()
    return centred / (centred.square().mean().sqrt() + eps)


def policy_loss(
    lp: torch.Tensor,
    gen_lp: torch.Tensor,
    token_adv: torch.Tensor,
    global_tokens: int,
    clip_eps: float,
    ref_lp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The group's loss (module docstring) and its detached parts, sums over the group's tokens:
    pg (the policy-gradient term), clipped (tokens where the clipped term was taken), ref_kl."""
    ratio = torch.exp(lp - gen_lp)
    unclipped = ratio * token_adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * token_adv
    pg = -torch.minimum(unclipped, clipped)
    total = pg.sum()
    parts = {"pg": float(pg.detach().sum()), "clipped": float((unclipped > clipped).sum()), "ref_kl": 0.0}
    if ref_lp is not None and kl_coef > 0:
        d = ref_lp - lp
        k3 = torch.exp(d) - d - 1.0
        total = total + kl_coef * k3.sum()
        parts["ref_kl"] = float(k3.detach().sum())
    return total / global_tokens, parts


GAP_FIELDS = ("tokens", "differing", "max_abs", "sum_abs", "k3_sum", "ratio_min", "ratio_sum", "ratio_max")


def gap_figures(trainer_lp: torch.Tensor, gen_lp: torch.Tensor) -> torch.Tensor:
    """float64 [8] (GAP_FIELDS) for one group's completion tokens: tokens compared, tokens with any
    bit difference, max |diff|, sum |diff|, sum of k3 (samples of the generator, KL(gen || trainer)),
    ratio min, ratio sum, ratio max; ratio = exp(trainer_lp - gen_lp)."""
    t, g = trainer_lp.detach().float(), gen_lp.float()
    assert t.shape == g.shape and t.dim() == 1, (t.shape, g.shape)
    if t.numel() == 0:
        return torch.tensor([0, 0, 0, 0, 0, float("inf"), 0, float("-inf")], dtype=torch.float64, device=t.device)
    differ = t.view(torch.int32) != g.view(torch.int32)
    log_r = t.double() - g.double()
    ratio = torch.exp(log_r)
    k3 = ratio - 1.0 - log_r
    one = torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device)
    return torch.stack(
        [
            one,
            differ.sum().double(),
            log_r.abs().max(),
            log_r.abs().sum(),
            k3.sum(),
            ratio.min(),
            ratio.sum(),
            ratio.max(),
        ]
    )


def combine_gap(rows: torch.Tensor, prefix: str) -> dict[str, float]:
    """The step's figures from the [V, 8] per-group rows (microbatch index order)."""
    tokens = float(rows[:, 0].sum())
    denominator = max(tokens, 1.0)
    if prefix == "ratio":
        return {
            "ratio_min": float(rows[:, 5].min()),
            "ratio_mean": float(rows[:, 6].sum()) / denominator,
            "ratio_max": float(rows[:, 7].max()),
        }
    return {
        f"{prefix}_tokens": int(tokens),
        f"{prefix}_tokens_differing": int(rows[:, 1].sum()),
        f"{prefix}_max_abs": float(rows[:, 2].max()),
        f"{prefix}_mean_abs": float(rows[:, 3].sum()) / denominator,
        f"{prefix}_k3_kl": float(rows[:, 4].sum()) / denominator,
    }
