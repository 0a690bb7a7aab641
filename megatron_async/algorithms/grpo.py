"""GRPO: group-normalised advantages over the K completions of each prompt, token-level clipped
surrogate against the learner before the update (Shao et al. 2024, DeepSeekMath).

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)       (std: unbiased, as TRL)
    loss = agg over completion tokens of  w_t * max(-A_i r_t, -A_i clip(r_t, 1 - eps, 1 + eps_high))
           + grpo_kl_coef * k3(pi_theta, ref)_t,   r_t = pi_theta / pi_old

Options GRPO users expect, each a `trainer.` key:
- `grpo_std_normalization: false` divides by nothing (Dr. GRPO, Liu et al. 2025: the std
  normalisation up-weights groups of near-tied rewards);
- `clip_eps_high` > clip_eps clips the ratio asymmetrically (DAPO's clip-higher, Yu et al. 2025);
- `loss_aggregation`: "token" averages over every completion token of the microbatch (DAPO and
  Dr. GRPO: long answers weigh by their length), "sequence" averages each completion's tokens,
  then the completions (the original GRPO);
- `grpo_kl_coef` > 0 adds DeepSeekMath's k3 KL to the reference to the loss (0, the default, as
  DAPO and Dr. GRPO: the KL to the reference is only logged).
Groups whose K rewards all tie have zero advantage everywhere and carry no signal: they are
skipped and counted (`grpo/tied_groups`), as Online DPO's tied prompts are (DAPO's dynamic
sampling, without resampling). The behaviour weights w_t of `trainer.off_policy_correction`
(`algorithms/off_policy.py`) are 1 without a correction. Departure: the token mean is per
microbatch (then the learner's row-weighted mean over microbatches), not over the whole batch.
"""
from __future__ import annotations

import torch

from megatron_async.algorithms.base import Algorithm, LearnerModels, Microbatch, real_rows_of, scatter_rows
from megatron_async.algorithms.batching import group_samples
from megatron_async.algorithms.losses import masked_mean
from megatron_async.sample import Sample

STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, k: int, normalise_std: bool) -> torch.Tensor:
    """[G * k] rewards, grouped contiguously -> [G * k] (r - group mean) [/ (group std + eps)]."""
    grouped = rewards.view(-1, k)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if normalise_std:
        centred = centred / (grouped.std(-1, keepdim=True) + STD_EPS)
    return centred.view(-1)


class GRPO(Algorithm):
    name = "grpo"
    grouped = True
    needs_old_logprobs = True
    corrects_off_policy = True

    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        rows, stats = group_samples(samples, k)
        groups = [rows[i:i + k] for i in range(0, len(rows), k)]
        kept = [g for g in groups if len({s.reward for s in g}) > 1]
        stats["grpo/tied_groups"] = float(len(groups) - len(kept))
        return [s for g in kept for s in g], stats

    def prepare(self, minibatches: list[list[Microbatch]], models: LearnerModels, k: int,
                old_from_training: bool = False) -> dict[str, torch.Tensor]:
        stats = super().prepare(minibatches, models, k, old_from_training)
        for mbs in minibatches:  # groups never straddle two minibatches
            adv = group_advantages(real_rows_of(mbs, "rewards"), k, self.cfg.grpo_std_normalization)
            scatter_rows(mbs, "advantages", adv)
        return stats

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        c, mask = self.cfg, mb["loss_mask"][:n]
        logp, old, ref = logprobs[:n], mb["old_logprobs"][:n], mb["ref_logprobs"][:n]
        adv = mb["advantages"][:n, None]
        ratio = torch.exp(logp - old)
        high = c.clip_eps if c.clip_eps_high is None else c.clip_eps_high
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - c.clip_eps, 1 + high)
        per_token = torch.max(unclipped, clipped)
        if "is_weights" in mb:
            per_token = per_token * mb["is_weights"][:n]
        metrics = {"policy/clipfrac": masked_mean((clipped > unclipped).float(), mask),
                   "policy/ratio": masked_mean(ratio.detach(), mask)}
        if c.grpo_kl_coef:
            k3 = torch.exp(ref - logp) - (ref - logp) - 1  # >= 0, unbiased for KL(pi || ref) under pi
            per_token = per_token + c.grpo_kl_coef * k3
            metrics["policy/kl_k3_ref"] = masked_mean(k3.detach(), mask)
        if c.loss_aggregation == "token":
            loss = masked_mean(per_token, mask)
        else:
            loss = masked_mean(per_token, mask, dim=-1).mean()
        return loss, {"loss/policy": loss.detach(), **metrics}
