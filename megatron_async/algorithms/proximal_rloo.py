"""Proximal RLOO: RLOO's advantages with the clipped sequence-level importance ratio against the
generating policy (vLLM's logprobs of the sample), the paper's off-policy-robust variant.

With `trainer.off_policy_correction` other than none the ratio is clipped against the learner
before the update and the behaviour weight of the whole sequence (truncated or masked) carries
the generator's part (`algorithms/off_policy.py`)."""
from __future__ import annotations

import torch

from megatron_async.algorithms.base import Microbatch
from megatron_async.algorithms.losses import proximal_rloo_loss
from megatron_async.algorithms.rloo import RLOO


class ProximalRLOO(RLOO):
    name = "proximal_rloo"

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        if self.correction == "none":  # the paper's: the sequence ratio against the generator
            return proximal_rloo_loss(logprobs[:n], mb["gen_logprobs"][:n], mb["loss_mask"][:n],
                                      mb["advantages"][:n], self.cfg.clip_eps)
        # corrected: the ratio against the learner before the update, times the behaviour weight
        return proximal_rloo_loss(logprobs[:n], mb["old_logprobs"][:n], mb["loss_mask"][:n], mb["advantages"][:n],
                                  self.cfg.clip_eps, mb["is_sequence_weights"][:n])
