"""Online DPO loss against the frozen reference (the initial SFT policy).

Online DPO (Guo et al., 2024; the paper's most off-policy-robust loss): for each prompt the
batch builder picks the best and worst of K fresh completions by reward (`batching.build_dpo_pairs`)
and the DPO loss (Rafailov et al., 2023) is applied to that pair:

    h      = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
    sigmoid: loss = -log sigmoid(beta * h)            (DPO, the paper's choice)
    ipo:     loss = (h - 1 / (2 * beta)) ** 2         (IPO, Azar et al., 2023)

Departures from the paper / common implementations:
- IPO is applied to SUMMED sequence logprobs, like the sigmoid loss. TRL's "ipo" averages the
  logprobs over tokens first; with sums, 1/(2*beta) targets a total log-ratio gap, so beta for
  IPO must be chosen with the completion length in mind.
- The loss is the mean over pairs in this (micro)batch; weighting across microbatches and
  data-parallel ranks is the learner's job.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO / IPO loss on [P] summed per-sequence logprobs of P (chosen, rejected) pairs.

    Returns (scalar loss, metrics). Metrics are detached 0-dim tensors (no host sync here):
    `rewards/chosen`, `rewards/rejected` = mean implicit rewards beta * (logp - ref_logp),
    `rewards/margin` = mean of their difference, `rewards/accuracy` = fraction of pairs whose
    chosen implicit reward is strictly larger.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"dpo beta must be > 0, got {beta}")
    chosen_logratio = policy_chosen_logps - ref_chosen_logps  # [P]
    rejected_logratio = policy_rejected_logps - ref_rejected_logps  # [P]
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    loss = losses.mean()

    chosen_rewards = (beta * chosen_logratio).detach()
    rejected_rewards = (beta * rejected_logratio).detach()
    metrics = {
        "loss/dpo": loss.detach(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
    }
    return loss, metrics
