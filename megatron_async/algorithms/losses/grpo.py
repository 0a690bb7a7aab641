"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised advantages and the token-level clipped
surrogate against the learner before the update, with the options of its successors.

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)       (std: unbiased, as TRL)
    loss = agg over completion tokens of  w_t * max(-A_i r_t, -A_i clip(r_t, 1 - eps, 1 + eps_high))
           + kl_coef * k3(pi_theta, ref)_t,   r_t = pi_theta / pi_old

- without the std normalisation, Dr. GRPO (Liu et al. 2025: it up-weights groups of near-tied
  rewards);
- eps_high > eps clips the ratio asymmetrically (DAPO's clip-higher, Yu et al. 2025);
- aggregation "token" averages over every completion token given (DAPO and Dr. GRPO: long answers
  weigh by their length), "sequence" averages each completion's tokens, then the completions (the
  original GRPO);
- kl_coef > 0 adds DeepSeekMath's k3 estimate of the KL to the reference (0: DAPO and Dr. GRPO).
w_t are behaviour importance weights (`algorithms.off_policy`), 1 without a correction.
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_async.algorithms.losses.common import masked_mean

STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, k: int, normalise_std: bool) -> torch.Tensor:
    """[G * k] rewards, grouped contiguously -> [G * k] (r - group mean) [/ (group std + eps)]."""
    grouped = rewards.view(-1, k)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if normalise_std:
        centred = centred / (grouped.std(-1, keepdim=True) + STD_EPS)
    return centred.view(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    aggregation: Literal["token", "sequence"] = "token",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of the module docstring. [B, T] logprobs, mask and `weights`, [B] advantages.

    Metrics: clipfrac (tokens where the clipped term is active), ratio, and with `kl_coef` the k3
    KL to the reference.
    """
    adv = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + high)
    per_token = torch.max(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    metrics = {"policy/clipfrac": masked_mean((clipped > unclipped).float(), mask),
               "policy/ratio": masked_mean(ratio.detach(), mask)}
    if kl_coef:
        k3 = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1  # >= 0, unbiased for KL(pi || ref) under pi
        per_token = per_token + kl_coef * k3
        metrics["policy/kl_k3_ref"] = masked_mean(k3.detach(), mask)
    if aggregation == "token":
        loss = masked_mean(per_token, mask)
    else:
        loss = masked_mean(per_token, mask, dim=-1).mean()
    return loss, {"loss/policy": loss.detach(), **metrics}
