"""PPO with a value model (TRL's PPOv2, as the paper).

Complete groups of K (only to keep DP shards and minibatches aligned with the other algorithms; PPO
itself needs no groups). Per token, reward r_t = -beta * (log pi_old - log ref) with the score added
at the last completion token; pi_old is the learner before the update (below), so the KL is the
learner's kernels on both sides (0 before the first update; vLLM's logprobs would add the two
engines' numerics: algorithms/rloo.py) and the reward is fixed for the whole update. V_old from the
value model (`learner/value.py`: the policy's initial weights or the reward model, a scalar head),
GAE (`trainer.gamma`, `trainer.lam`) -> advantages and returns; advantages whitened over all
completion tokens of this DP rank's share of the batch (TRL whitens per process), returns not. "Old"
logprobs for the ratio are the LEARNER's, recomputed before the update's first optimizer step
(classic PPO, as TRL; the generation lag is not importance-corrected, proximal_rloo does that).
Policy: clipped surrogate (`trainer.clip_eps`), token-mean per microbatch. Value model: its own
optimizer step on `trainer.vf_coef` x the clipped value loss (clip range `clip_eps`) on the same
microbatches right after each policy step. vf_coef only scales the value gradients (TRL sums both
losses under one optimizer); under Adam it matters through gradient clipping.
"""
from __future__ import annotations

from typing import Iterable

import torch

from megatron_async.algorithms.batching import group_samples
from megatron_async.algorithms.base import Algorithm, LearnerModels, Microbatch, Rule, attach
from megatron_async.algorithms.losses import (
    gae,
    kl_penalized_rewards,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    sequence_kl,
)
from megatron_async.sample import Sample



class PPO(Algorithm):
    name = "ppo"
    grouped = True
    min_k = 1
    value_model = True
    needs_old_logprobs = True
    corrects_off_policy = True

    @classmethod
    def rules(cls, cfg) -> Iterable[Rule]:
        yield from super().rules(cfg)
        t = cfg.trainer
        yield t.value_lr is None or t.value_lr > 0, "trainer.value_lr", t.value_lr, "must be > 0 (or null = trainer.lr)"
        yield t.vf_coef > 0, "trainer.vf_coef", t.vf_coef, "must be > 0 (the value model learns from it)"
        yield 0 <= t.gamma <= 1, "trainer.gamma", t.gamma, "a discount must be in [0, 1]"
        yield 0 <= t.lam <= 1, "trainer.lam", t.lam, "GAE lambda must be in [0, 1]"
        yield t.clip_eps > 0, "trainer.clip_eps", t.clip_eps, "must be > 0"

    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        return group_samples(samples, k)

    def prepare(self, minibatches: list[list[Microbatch]], models: LearnerModels, k: int,
                old_from_training: bool = False) -> dict[str, torch.Tensor]:
        """pi_old (`Algorithm.prepare`) and V_old, both models before this batch's first update,
        then advantages and returns over ALL the given microbatches (`add_advantages`)."""
        stats = super().prepare(minibatches, models, k, old_from_training)
        for mbs in minibatches:
            attach(mbs, "old_values", models.values(mbs))
        return {**stats, **self.add_advantages([mb for mbs in minibatches for mb in mbs])}

    def add_advantages(self, mbs: list[Microbatch]) -> dict[str, torch.Tensor]:
        """Advantages and returns from KL-shaped per-token rewards and GAE over V_old.

        Needs `ref_logprobs`, `old_logprobs` and `old_values` in each microbatch; adds `advantages`
        (whitened over every completion token of the real rows of ALL the given microbatches, 0
        elsewhere) and `returns` (advantages + V_old, before whitening). Returns batch statistics.
        """
        c = self.cfg
        tokens = []  # per microbatch: [b, s], 1 on completion tokens of real rows
        advantages, returns_of = [], []
        for mb in mbs:
            mask = mb["loss_mask"]
            rewards = kl_penalized_rewards(mb["rewards"], mb["old_logprobs"], mb["ref_logprobs"], mask, c.beta)
            adv, ret = gae(rewards, mb["old_values"], mask, c.gamma, c.lam)
            advantages.append(adv)
            returns_of.append(ret)
            real = torch.arange(mask.shape[0], device=mask.device) < mb["real_rows"]
            tokens.append(((mask > 0) & real[:, None]).to(mask.dtype))
        attach(mbs, "returns", returns_of)

        def flat(per_mb: list[torch.Tensor]) -> torch.Tensor:  # microbatches may differ in length
            return torch.cat([t.flatten() for t in per_mb])

        raw_advantages, on = flat(advantages), flat(tokens)
        white = masked_whiten(raw_advantages, on).split([t.numel() for t in tokens])
        attach(mbs, "advantages", [w.view_as(a) for w, a in zip(white, advantages)])
        returns, values = flat(returns_of), flat([mb["old_values"] for mb in mbs])
        residual = returns - values
        kl = torch.cat([sequence_kl(mb["old_logprobs"], mb["ref_logprobs"], mb["loss_mask"])[:mb["real_rows"]]
                        for mb in mbs])
        return {"ppo/kl": kl.mean(), "ppo/advantage_raw_mean": masked_mean(raw_advantages, on),
                "ppo/return_mean": masked_mean(returns, on), "ppo/value_old_mean": masked_mean(values, on),
                # 1 - Var(R - V) / Var(R): how much of the returns' variance V_old explains (1 = all)
                "ppo/explained_variance": 1 - _masked_var(residual, on) / _masked_var(returns, on).clamp(min=1e-8)}

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        weights = mb["is_weights"][:n] if "is_weights" in mb else None
        return ppo_policy_loss(logprobs[:n], mb["old_logprobs"][:n], mb["advantages"][:n], mb["loss_mask"][:n],
                               self.cfg.clip_eps, weights)

    def value_loss(self, values: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, dict]:
        """The value model's per-microbatch loss: vf_coef x the clipped value loss."""
        n = mb["real_rows"]
        loss, metrics = ppo_value_loss(values[:n], mb["old_values"][:n], mb["returns"][:n], mb["loss_mask"][:n],
                                       self.cfg.clip_eps)
        return self.cfg.vf_coef * loss * mb["loss_scale"], metrics


def _masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of x over the masked elements."""
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)
