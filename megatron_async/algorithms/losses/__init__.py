"""Loss functions: pure tensor functions on [B, T] per-token logprobs and completion masks.

Each returns (loss, metrics) where metrics are detached 0-dim tensors; no collectives, no
knowledge of processes, Megatron or vLLM. `common`: masked reductions and the KL-to-reference
estimate; `dpo`: Online DPO / IPO; `grpo`: GRPO's group-normalised advantages and loss; `ppo`: KL-shaped rewards, GAE, clipped policy and value losses;
`rloo`: RLOO and Proximal RLOO; `sft`: Best-of-K SFT's negative log-likelihood.
"""
from megatron_async.algorithms.losses.common import masked_mean, masked_sum, sequence_kl, sequence_logprobs
from megatron_async.algorithms.losses.dpo import dpo_loss
from megatron_async.algorithms.losses.grpo import group_advantages, grpo_loss
from megatron_async.algorithms.losses.ppo import gae, kl_penalized_rewards, masked_whiten, ppo_policy_loss, ppo_value_loss
from megatron_async.algorithms.losses.rloo import proximal_rloo_loss, rloo_advantages, rloo_loss
from megatron_async.algorithms.losses.sft import best_of_k_sft_loss

__all__ = [
    "best_of_k_sft_loss",
    "dpo_loss",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "ppo_policy_loss",
    "ppo_value_loss",
    "proximal_rloo_loss",
    "rloo_advantages",
    "rloo_loss",
    "sequence_kl",
    "sequence_logprobs",
]
