"""Best-of-K SFT: the best completion of each prompt if it is an exact match (reward 1), NLL loss.
The SFT warm-up (`run/sft.py`) trains the reference solutions with the same loss."""
from __future__ import annotations

from typing import Iterable

import torch

from megatron_async.algorithms.batching import select_best_of_k
from megatron_async.algorithms.base import Algorithm, Microbatch, Rule
from megatron_async.algorithms.losses import best_of_k_sft_loss
from megatron_async.sample import Sample



class BestOfKSFT(Algorithm):
    name = "best_of_k_sft"

    @classmethod
    def rules(cls, cfg) -> Iterable[Rule]:
        yield from super().rules(cfg)
        yield (cfg.reward.kind == "gsm8k_exact_match", "trainer.algorithm", cls.name,
               "trains on completions that are an exact match (reward 1): needs reward.kind=gsm8k_exact_match")

    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        return select_best_of_k(samples, min_reward=1.0)

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        return best_of_k_sft_loss(logprobs[:n], mb["loss_mask"][:n])
