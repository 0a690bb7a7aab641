"""RLOO: REINFORCE with a leave-one-out baseline over the K completions of each prompt.

Complete groups of K per prompt; sequence reward R = score - beta * KL(policy || ref), the KL summed
over completion tokens with the LEARNER's logprobs before the update (`old_logprobs`) against the
reference's, both from the learner's kernels; leave-one-out advantages over the group
(`losses.rloo`); REINFORCE loss. `proximal_rloo` is the off-policy-robust variant.

Why not the generator's (vLLM's) logprobs, which come free with the sample: they differ from the
learner's by the two engines' numerics, and the KL then is not 0 before the first update (bf16
SmolLM2, measured in docs/real-models.md). Leave-one-out turns that noise into advantages on every
group whose scores are all equal, so a step without one right sample still moved the policy, and
with the clip at 1.0 as far as a step with signal. The
learner's own logprobs are what TRL, OpenRLHF and verl put in the reward too. They cost nothing
extra under the async default (the correction's weights read them); with `beta: 0` they are not
computed.
"""
from __future__ import annotations

import torch

from megatron_async.algorithms.batching import group_samples
from megatron_async.algorithms.base import Algorithm, LearnerModels, Microbatch, in_row_order, real_rows_of, scatter_rows
from megatron_async.algorithms.losses import rloo_advantages, rloo_loss, sequence_kl
from megatron_async.sample import Sample


class RLOO(Algorithm):
    name = "rloo"
    grouped = True
    corrects_off_policy = True

    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        return group_samples(samples, k)

    def loss_needs_old_logprobs(self, mbs: list[Microbatch]) -> bool:
        """Besides a correction's weights, the KL in the reward reads them (beta > 0)."""
        return self.cfg.beta > 0 or super().loss_needs_old_logprobs(mbs)

    def prepare(self, minibatches: list[list[Microbatch]], models: LearnerModels, k: int,
                old_from_training: bool = False) -> dict[str, torch.Tensor]:
        """Advantages per minibatch (groups never straddle two); statistics averaged over minibatches."""
        stats = super().prepare(minibatches, models, k, old_from_training)
        kls, regularised = [], []
        for mbs in minibatches:
            rewards = real_rows_of(mbs, "rewards")
            if self.cfg.beta:
                kl = in_row_order(mbs, [sequence_kl(mb["old_logprobs"], mb["ref_logprobs"], mb["loss_mask"]) for mb in mbs])
                rewards = rewards - self.cfg.beta * kl
                kls.append(kl.mean())
            scatter_rows(mbs, "advantages", rloo_advantages(rewards, k))
            regularised.append(rewards.mean())
        if kls:
            stats["rloo/kl"] = torch.stack(kls).mean()
        return {**stats, "rloo/regularised_reward": torch.stack(regularised).mean()}

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        weights = mb["is_weights"][:n] if "is_weights" in mb else None
        return rloo_loss(logprobs[:n], mb["loss_mask"][:n], mb["advantages"][:n], weights)
