"""Training on samples from an older policy: importance corrections and the staleness monitor.

Three policies meet in an asynchronous step (AReaL's and verl's names):
    behaviour mu      the generator: vLLM's logprobs of each sampled token (`gen_logprobs`)
    proximal pi_prox  the learner before this batch's first update (`old_logprobs`)
    current pi_theta  the learner being trained (the loss's `logprobs`)
The generator-to-current ratio splits into a behaviour weight w = pi_prox / mu, which these
corrections treat, and a policy ratio pi_theta / pi_prox, which PPO and GRPO clip as they always
did (and Proximal RLOO, under any correction, instead of its paper ratio pi_theta / mu).
`trainer.off_policy_correction`:

    none       no behaviour weight (w = 1): the paper's losses, so its results stay reproducible.
    tis        truncated importance sampling: w = min(pi_prox / mu, is_cap) per token (slime
               --use-tis, TRL's vLLM IS correction, verl token-TIS).
    icepop     w = pi_prox / mu where it lies in [icepop_low, icepop_high], else 0: the token is
               dropped (IcePop; OpenRLHF, verl).
    decoupled  AReaL's decoupled PPO: w = pi_prox / mu, tokens with w > is_cap dropped.
    auto       (the default) tis when rollout.max_lag != 0, none for the synchronous baseline.

Why tis for asynchronous runs: every peer that trains off-policy corrects against the generator,
and with none PPO that anchors to the learner silently ignores staleness (plain PPO on GSM8k has
been seen to collapse at lag 1 where PPO + TIS did not, on GSM8k with Qwen3-0.6B); truncation keeps the variance
bounded where masking (icepop, decoupled) throws tokens away. Online DPO and Best-of-K SFT take no
weight: their losses do not estimate an on-policy gradient.

Weights are per token for token-level losses (PPO, GRPO, RLOO's REINFORCE sum) and per sequence
(the product over its tokens) for Proximal RLOO's sequence ratio; they are detached and computed
once per batch, before the update.

The staleness monitor (`staleness_stats`) measures the same split on the trained tokens:
KL(mu || pi_prox) by the k3 estimator ((r - 1) - log r, r = pi_prox / mu, unbiased and >= 0 per
token for samples from mu), the weights' mean and max, and their effective sample size fraction
(sum w)^2 / (n sum w^2) (1 = on-policy).
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_async.algorithms.losses import masked_mean


Correction = Literal["none", "tis", "icepop", "decoupled"]


def resolve_correction(cfg) -> Correction:
    """trainer.off_policy_correction with `auto` resolved (see the module docstring)."""
    kind = cfg.trainer.off_policy_correction
    if kind == "auto":
        return "none" if cfg.rollout.max_lag == 0 else "tis"
    return kind


def behaviour_weights(old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor, kind: Correction,
                      cap: float, low: float, high: float) -> torch.Tensor:
    """[B, T] weights w(pi_prox / mu) on the completion tokens (0 off the mask), detached."""
    if kind == "none":
        return mask.to(old_logprobs.dtype)
    return _weigh(torch.exp((old_logprobs - gen_logprobs).detach()) * mask, kind, cap, low, high)


def sequence_weights(old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor, kind: Correction,
                     cap: float, low: float, high: float) -> torch.Tensor:
    """[B] weights of whole sequences: w applied to prod_t pi_prox / mu (Proximal RLOO's ratio)."""
    ratio = torch.exp(((old_logprobs - gen_logprobs).detach() * mask).sum(-1))
    return torch.ones_like(ratio) if kind == "none" else _weigh(ratio, kind, cap, low, high)


def _weigh(ratio: torch.Tensor, kind: Correction, cap: float, low: float, high: float) -> torch.Tensor:
    """The correction's weight of each importance ratio pi_prox / mu (module docstring)."""
    if kind == "tis":
        return ratio.clamp(max=cap)
    if kind == "icepop":
        return ratio * ((ratio >= low) & (ratio <= high))
    if kind == "decoupled":
        return ratio * (ratio <= cap)
    raise ValueError(f"unknown off-policy correction {kind!r}")


def staleness_stats(old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(generator || learner before the update) and importance-weight statistics on the masked
    tokens, as 0-dim tensors (`staleness/...`)."""
    log_r = (old_logprobs - gen_logprobs).detach() * mask
    r = torch.exp(log_r) * mask
    k3 = (r - 1) * mask - log_r  # 0 off the mask
    on = mask > 0
    n = mask.sum().clamp(min=1)
    return {"staleness/kl_k3_mean": masked_mean(k3, mask),
            "staleness/kl_k3_max": torch.where(on, k3, torch.zeros_like(k3)).max(),
            "staleness/iw_mean": masked_mean(r, mask),
            "staleness/iw_max": torch.where(on, r, torch.zeros_like(r)).max(),
            "staleness/ess_fraction": r.sum() ** 2 / (n * (r ** 2).sum()).clamp(min=1e-12)}
