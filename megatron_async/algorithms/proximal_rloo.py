"""Proximal RLOO: RLOO's advantages with the clipped sequence-level importance ratio against the
generating policy (vLLM's logprobs of the sample), the paper's off-policy-robust variant."""
from __future__ import annotations

import torch

from megatron_async.algorithms.base import Microbatch
from megatron_async.algorithms.losses import proximal_rloo_loss
from megatron_async.algorithms.rloo import RLOO


class ProximalRLOO(RLOO):
    name = "proximal_rloo"

    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        return proximal_rloo_loss(logprobs[:n], mb["gen_logprobs"][:n], mb["loss_mask"][:n], mb["advantages"][:n],
                                  self.cfg.clip_eps)
