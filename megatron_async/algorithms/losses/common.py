"""Masked reductions shared by every loss, and the KL-to-reference estimate.

Conventions used by all of `megatron_async.algorithms.losses`:
- `logprobs`, `ref_logprobs`, `gen_logprobs`: float [B, T], the log-probability of token t of
  row b under the current policy / the frozen reference / the policy that generated the sample.
  Position t holds the logprob OF token t (targets-aligned, see `batching.py`).
- `mask`: [B, T], 1 on completion tokens that are trained on, 0 on prompt and padding tokens.
"""
from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x where mask is 1 (over all elements when dim is None)."""
    x = x * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over masked elements. An all-zero mask gives 0, not NaN (clamp of the count)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token logprobs -> [B] summed log-probability of each completion."""
    return masked_sum(logprobs, mask, dim=-1)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence KL estimate to the reference: sum over completion tokens of logp - ref_logp.

    This is the k1 estimator of KL(pi || ref) for samples drawn from pi: unbiased, but a single
    sequence's value can be negative. It is what PPO/RLOO fold into the reward (Ziegler et al.;
    the paper follows TRL) and what every loss logs as `kl` for comparability across losses.
    """
    return masked_sum(logprobs - ref_logprobs, mask, dim=-1)
