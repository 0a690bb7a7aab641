"""Best-of-K SFT: negative log-likelihood of the best of K completions per prompt.

The paper's Best-of-2 SFT baseline: sample K completions, keep the highest-reward one
(`batching.select_best_of_k`, which runs BEFORE the forward pass so only kept rows are computed),
and train on it with the ordinary language-modelling loss on completion tokens.

Departures: the NLL is averaged over all completion tokens of the batch (token-level mean, the
usual SFT reduction), so long completions weigh more than short ones; there is no KL term.
"""
from __future__ import annotations

import torch

from megatron_async.algorithms.losses.common import masked_mean


def best_of_k_sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean NLL over the completion mask of the already-selected best completions [B, T]."""
    loss = -masked_mean(logprobs, mask)
    metrics = {"loss/nll": loss.detach(), "sft/tokens": mask.sum().detach().to(logprobs.dtype)}
    return loss, metrics
