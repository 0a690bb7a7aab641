"""RLOO: REINFORCE with a leave-one-out baseline over the K completions of each prompt.

Complete groups of K per prompt; sequence reward R = score - beta * KL(gen || ref), the KL summed
over completion tokens with the generating policy's logprobs; leave-one-out advantages over the
group (`losses.rloo`); REINFORCE loss. No correction for samples from an older policy:
`proximal_rloo` is the off-policy-robust variant.
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

    def prepare(self, minibatches: list[list[Microbatch]], models: LearnerModels, k: int,
                old_from_training: bool = False) -> dict[str, torch.Tensor]:
        """Advantages per minibatch (groups never straddle two); statistics averaged over minibatches."""
        stats = super().prepare(minibatches, models, k, old_from_training)
        kls, regularised = [], []
        for mbs in minibatches:
            scores = real_rows_of(mbs, "rewards")
            kl = in_row_order(mbs, [sequence_kl(mb["gen_logprobs"], mb["ref_logprobs"], mb["loss_mask"]) for mb in mbs])
            scatter_rows(mbs, "advantages", rloo_advantages(scores - self.cfg.beta * kl, k))
            kls.append(kl.mean())
            regularised.append((scores - self.cfg.beta * kl).mean())
        return {**stats, "rloo/kl": torch.stack(kls).mean(), "rloo/regularised_reward": torch.stack(regularised).mean()}

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        weights = mb["is_weights"][:n] if "is_weights" in mb else None
        return rloo_loss(logprobs[:n], mb["loss_mask"][:n], mb["advantages"][:n], weights)
