"""PPO pieces for RLHF: KL-shaped per-token rewards, GAE, clipped policy and value losses.

Follows the paper's PPO (TRL's PPOv2, itself after Ziegler et al. 2019 and Huang et al. 2024,
"The N+ implementation details of RLHF with PPO"):
- per-token reward r_t = -kl_coef * (log pi_old(a_t) - log ref(a_t)), plus the scalar score of the
  whole completion at its LAST completion token;
- advantages by GAE over the completion tokens (the prompt is the initial state, no reward);
- the clipped surrogate on the per-token ratio pi_theta / pi_old, and a clipped value loss;
- means are over all completion tokens of the batch (token-level), as in TRL.

Off-policy note: "old" is whatever policy the learner passes as `old_logprobs`. In the
asynchronous setting the samples come from an earlier version; passing the generating policy's
logprobs (from vLLM) makes the ratio an explicit off-policy correction, passing logprobs the
learner recomputes at the start of the update is classic PPO. The learner picks; this module does
no communication and has no view of versions.
"""
from __future__ import annotations

import torch

from megatron_async.algorithms.losses.common import masked_mean


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] completion mask -> [B] index of each row's last completion token."""
    if not mask.is_meta and bool((mask.sum(-1) == 0).any()):  # (shape-only meta tensors: no data to check)
        raise ValueError("a row of the completion mask is all zero: every sample needs >= 1 completion token")
    T = mask.shape[-1]
    return T - 1 - mask.long().flip(-1).argmax(-1)


def kl_penalized_rewards(
    scores: torch.Tensor,
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """[B] scores + [B, T] logprobs -> [B, T] per-token rewards (0 off the completion mask).

    The KL term's policy logprobs are the learner's before the update (fixed for the whole update,
    as in TRL, and from the reference's kernels: algorithms/ppo.py).
    """
    rewards = -kl_coef * (policy_logprobs - ref_logprobs) * mask
    last = last_token_index(mask)
    rewards[torch.arange(rewards.shape[0]), last] += scores.to(rewards.dtype)
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked span of each row -> (advantages, returns).

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}

    with V and A of the position after the last completion token taken as 0 (the episode ends
    there). Each row's mask must be ONE contiguous span (prompt, completion, padding); a hole would
    silently cut the episode in two, so it is rejected. Outside the mask both outputs are 0.
    """
    starts = (mask[:, 1:] > mask[:, :-1]).sum(-1) + (mask[:, 0] > 0).long()
    if not mask.is_meta and bool((starts > 1).any()):
        raise ValueError("gae: each row's completion mask must be a single contiguous span")
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t].to(rewards.dtype)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * m  # reset to 0 off the span
        next_value = values[:, t] * m
        advantages[:, t] = next_adv
    returns = (advantages + values) * mask
    return advantages, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over masked elements (population std); 0 off the mask.

    Apply to the advantages once per batch before splitting into minibatches (TRL does this).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    weights: torch.Tensor | None = None,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate, token-level: mean over mask of w * max(-A r, -A clip(r, 1-eps, 1+eps_high)),
    r = exp(logprobs - old_logprobs); `weights` w [B, T] are behaviour importance weights
    (`algorithms.off_policy`, default 1) and `clip_eps_high` the upper clip (DAPO's clip-higher,
    default clip_eps). Metrics: clipfrac, approx_kl (0.5 * mean logratio^2), ratio.
    """
    logratio = logprobs - old_logprobs
    ratio = torch.exp(logratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = torch.max(pg_losses, pg_losses_clipped)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    metrics = {
        "loss/policy": loss.detach(),
        "policy/clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), mask).detach(),
        "policy/approx_kl": masked_mean(0.5 * logratio.detach() ** 2, mask),
        "policy/ratio": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * mean over mask of max((V - R)^2, (V_clip - R)^2),
    V_clip = old_V + clip(V - old_V, -eps, +eps). Metrics: vf_clipfrac, mean value.
    """
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    vf_losses = (values - returns) ** 2
    vf_losses_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_losses, vf_losses_clipped), mask)
    metrics = {
        "loss/value": loss.detach(),
        "value/clipfrac": masked_mean((vf_losses_clipped > vf_losses).float(), mask).detach(),
        "value/mean": masked_mean(values.detach(), mask),
    }
    return loss, metrics
