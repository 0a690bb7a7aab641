"""GRPO: group-normalised advantages over the K completions of each prompt, token-level clipped
surrogate against the learner before the update (Shao et al. 2024, DeepSeekMath). The arithmetic
and what each option means: `losses/grpo.py`.

The options, each a `trainer.` key: `grpo_std_normalization` (false: Dr. GRPO), `clip_eps_high`
(DAPO's clip-higher), `loss_aggregation` ("token" over every completion token of the microbatch,
"sequence" per completion, the original GRPO), `grpo_kl_coef` (0, the default, as DAPO and
Dr. GRPO: the KL to the reference is only logged).
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
from megatron_async.algorithms.losses import group_advantages, grpo_loss
from megatron_async.sample import Sample


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
        c = self.cfg
        return grpo_loss(logprobs[:n], mb["old_logprobs"][:n], mb["ref_logprobs"][:n], mb["advantages"][:n],
                         mb["loss_mask"][:n], c.clip_eps, c.clip_eps_high, c.grpo_kl_coef, c.loss_aggregation,
                         mb["is_weights"][:n] if "is_weights" in mb else None)
