"""Online DPO (the default, the paper's most off-policy-robust loss).

Per prompt, the best vs the worst of K completions by reward (ties skipped and counted); rows of a
pair are adjacent ([c0, r0, c1, r1, ...]) so a microbatch never splits a pair; the DPO (sigmoid) or
IPO loss against the frozen reference, plus `trainer.dpo_nll_coef` x the chosen's token-mean NLL
when set (RPO, Pang et al. 2024).
"""
from __future__ import annotations

import torch

from megatron_async.algorithms.batching import build_dpo_pairs
from megatron_async.algorithms.base import Algorithm, Microbatch
from megatron_async.algorithms.losses import best_of_k_sft_loss, dpo_loss, sequence_logprobs
from megatron_async.sample import Sample


class OnlineDPO(Algorithm):
    name = "online_dpo"
    pairwise = True

    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        pairs, stats = build_dpo_pairs(samples)
        return [s for pair in pairs for s in pair], stats  # [c0, r0, c1, r1, ...]

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        mask = mb["loss_mask"]
        seq, ref = sequence_logprobs(logprobs, mask), sequence_logprobs(mb["ref_logprobs"], mask)
        pairs = n // 2
        loss, metrics = dpo_loss(seq[0::2][:pairs], seq[1::2][:pairs], ref[0::2][:pairs], ref[1::2][:pairs],
                                 self.cfg.beta, self.cfg.dpo_loss)
        if self.cfg.dpo_nll_coef:  # RPO: + coef * token-mean NLL of the chosen completions
            nll, _ = best_of_k_sft_loss(logprobs[0::2][:pairs], mask[0::2][:pairs])
            loss = loss + self.cfg.dpo_nll_coef * nll
            metrics["loss/chosen_nll"] = nll.detach()
        return loss, metrics
