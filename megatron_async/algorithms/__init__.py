"""From a scored rollout batch to microbatches and a loss function, per algorithm.

Every algorithmic choice of a learner step is visible here (cleanrl style); the loss arithmetic
itself lives in `losses/` and the padding in `batching`. One learner step on one batch:

    microbatches = build_microbatches(cfg, samples, pad_id, n_rows)     # same [b, s] for all
    ref/old logprobs are added to each microbatch by the trainer (frozen reference model)
    loss_fn = make_loss_fn(cfg)          # called by learner.logprobs.forward_backward
    PPO also: old values (value model), add_ppo_advantages, make_value_loss_fn (value model step)

Algorithms (trainer.algorithm):
- online_dpo: per prompt, best vs worst of K by reward (ties skipped and counted); rows of a pair
  are adjacent ([c0, r0, c1, r1, ...]) so a microbatch never splits a pair; DPO/IPO loss against
  the frozen reference, plus `dpo_nll_coef` x the chosen's token-mean NLL when set (RPO).
- rloo: complete groups of K per prompt; sequence reward R = score - beta * KL(gen || ref), with
  KL summed over completion tokens using the generating policy's logprobs; leave-one-out
  advantages over the group; REINFORCE loss.
- proximal_rloo: as rloo, with the clipped sequence-level importance ratio against the generating
  policy (vLLM's logprobs of the sample), the paper's off-policy-robust variant.
- best_of_k_sft: the best completion of each prompt if it scored 1 (exact match), NLL loss.
- ppo (TRL's PPOv2, as the paper): complete groups of K (only to keep DP shards and minibatches
  aligned with the other algorithms; PPO itself needs no groups). Per token, reward
  r_t = -beta * (log pi_gen - log ref) with the score added at the last completion token; the KL
  uses the GENERATING policy's (vLLM's) logprobs, so the reward is fixed for the whole update.
  V_old from the value model (`learner.value`: the policy's initial weights, a scalar head), GAE
  (`trainer.gamma`, `trainer.lam`) -> advantages and returns; advantages whitened over all
  completion tokens of this DP rank's share of the batch (TRL whitens per process), returns not.
  "Old" logprobs for the ratio are the LEARNER's, recomputed before the update's first optimizer
  step (classic PPO, as TRL; the generation lag is not importance-corrected, proximal_rloo does
  that). Policy: clipped surrogate (`trainer.clip_eps`), token-mean per microbatch. Value model:
  its own optimizer step on `trainer.vf_coef` x the clipped value loss (clip range `clip_eps`) on
  the same microbatches right after each policy step. vf_coef only scales the value gradients
  (TRL sums both losses under one optimizer); under Adam it matters through gradient clipping.

Padding rows: the last microbatch is filled with copies of row 0 that carry `row_weight` 0, so
every microbatch has the same shape (pipeline buffers are fixed) and padding adds nothing to the
loss or the gradients. Each microbatch's loss is scaled so that the mean over microbatches (what
the schedule computes) is the mean over real rows (pairs for DPO).
"""
from __future__ import annotations

import torch

from megatron_async.algorithms import batching
from megatron_async.algorithms.losses import (
    best_of_k_sft_loss,
    dpo_loss,
    gae,
    kl_penalized_rewards,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    proximal_rloo_loss,
    rloo_advantages,
    rloo_loss,
    sequence_kl,
    sequence_logprobs,
)

PAIRWISE = ("online_dpo",)


def select_samples(algorithm: str, samples: list[batching.Sample], k: int) -> tuple[list[batching.Sample], dict]:
    """Which samples are trained on, in row order, with selection statistics."""
    if algorithm == "online_dpo":
        pairs, stats = batching.build_dpo_pairs(samples)
        return [s for pair in pairs for s in pair], stats  # [c0, r0, c1, r1, ...]
    if algorithm in ("rloo", "proximal_rloo", "ppo"):
        return batching.group_samples(samples, k)
    if algorithm == "best_of_k_sft":
        return batching.select_best_of_k(samples, min_reward=1.0)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def row_unit(algorithm: str, k: int) -> int:
    """Rows that must stay together: a DPO pair, a group of K for the leave-one-out baseline."""
    return 2 if algorithm in PAIRWISE else k if algorithm in ("rloo", "proximal_rloo", "ppo") else 1


def split_units(rows: list, unit: int, n: int) -> list[list]:
    """Deal rows out to at most n parts, `unit` consecutive rows at a time (every part non-empty)."""
    units = [rows[i:i + unit] for i in range(0, len(rows), unit)]
    n = max(1, min(n, len(units)))
    return [[r for u in units[i::n] for r in u] for i in range(n)]


def dp_shard(rows: list, unit: int, dp: int, dp_rank: int) -> list:
    """This data-parallel rank's share of `rows` (DDP averages the ranks' gradients).

    With fewer units than ranks every rank takes all rows: the same gradient, just not split
    (a rank with nothing would have no microbatch to run its collectives on). With an uneven split
    the DDP average of per-rank means weighs the smaller shards' rows slightly more.
    """
    if dp == 1 or len(rows) // unit < dp:
        return rows
    return split_units(rows, unit, dp)[dp_rank]


def build_microbatches(algorithm: str, rows: list[batching.Sample], pad_id: int, micro_batch_size: int,
                       k: int, beta: float) -> list[dict]:
    """Rows (from `select_samples`) -> microbatches of exactly `micro_batch_size` rows.

    Keys: input_ids, loss_mask (completion tokens), gen_logprobs, rewards, row_weight, and for
    RLOO the raw scores (advantages need the reference KL, added by `add_rloo_advantages`).
    """
    if not rows:
        return []
    if algorithm in PAIRWISE and micro_batch_size % 2:
        micro_batch_size += 1  # a pair never straddles two microbatches
    batch = batching.collate(rows, pad_id)
    n = len(rows)
    n_mb = -(-n // micro_batch_size)
    pad = n_mb * micro_batch_size - n
    index = torch.cat([torch.arange(n), torch.zeros(pad, dtype=torch.long)])
    weight = torch.cat([torch.ones(n), torch.zeros(pad)])
    real_units = n // 2 if algorithm in PAIRWISE else n
    out = []
    for m in range(n_mb):
        sl = index[m * micro_batch_size:(m + 1) * micro_batch_size]
        w = weight[m * micro_batch_size:(m + 1) * micro_batch_size]
        units = int(w.sum().item()) // (2 if algorithm in PAIRWISE else 1)
        mb = {
            "input_ids": batch.input_ids[sl],
            "loss_mask": batch.completion_mask[sl],
            "rewards": batch.rewards[sl],
            "row_weight": w,
            # mean over microbatches of (loss_mb * scale) == mean over all real rows / pairs
            "loss_scale": torch.tensor(units * n_mb / real_units),
        }
        if batch.gen_logprobs is not None:
            mb["gen_logprobs"] = batch.gen_logprobs[sl]
        out.append(mb)
    return out


def add_rloo_advantages(microbatches: list[dict], k: int, beta: float) -> dict:
    """RLOO advantages from KL-regularised rewards; needs `ref_logprobs` in each microbatch.

    Groups of k are contiguous in row order, so advantages are computed over the concatenation
    of the microbatches' real rows and scattered back.
    """
    real = [mb["row_weight"] > 0 for mb in microbatches]
    scores = torch.cat([mb["rewards"][r] for mb, r in zip(microbatches, real)])
    kl = torch.cat([sequence_kl(mb["gen_logprobs"], mb["ref_logprobs"], mb["loss_mask"])[r]
                    for mb, r in zip(microbatches, real)])
    adv = rloo_advantages(scores - beta * kl, k)
    start = 0
    for mb, r in zip(microbatches, real):
        n = int(r.sum())
        mb["advantages"] = torch.zeros(len(r))
        mb["advantages"][r] = adv[start:start + n]
        start += n
    return {"rloo/kl": kl.mean().item(), "rloo/regularised_reward": (scores - beta * kl).mean().item()}


def add_ppo_advantages(microbatches: list[dict], kl_coef: float, gamma: float, lam: float) -> dict:
    """PPO advantages and returns from KL-shaped per-token rewards and GAE over V_old.

    Needs `ref_logprobs`, `gen_logprobs` and `old_values` in each microbatch; adds `advantages`
    (whitened over every completion token of the real rows of ALL the given microbatches, 0
    elsewhere) and `returns` (advantages + V_old, before whitening). Returns batch metrics.
    """
    if any("gen_logprobs" not in mb for mb in microbatches):
        raise ValueError("trainer.algorithm=ppo: the KL-shaped reward needs the generating policy's logprobs, "
                         "and some samples came without them")
    tokens = []  # per microbatch: [b, s] bool, completion tokens of real rows
    for mb in microbatches:
        mask = mb["loss_mask"]
        rewards = kl_penalized_rewards(mb["rewards"], mb["gen_logprobs"], mb["ref_logprobs"], mask, kl_coef)
        mb["advantages"], mb["returns"] = gae(rewards, mb["old_values"], mask, gamma, lam)
        tokens.append((mask > 0) & (mb["row_weight"] > 0)[:, None])
    raw = torch.cat([mb["advantages"][t] for mb, t in zip(microbatches, tokens)])
    white = masked_whiten(raw, torch.ones_like(raw))
    start = 0
    for mb, t in zip(microbatches, tokens):
        n = int(t.sum())
        mb["advantages"] = torch.zeros_like(mb["advantages"])
        mb["advantages"][t] = white[start:start + n]
        start += n
    returns = torch.cat([mb["returns"][t] for mb, t in zip(microbatches, tokens)])
    values = torch.cat([mb["old_values"][t] for mb, t in zip(microbatches, tokens)])
    real = [mb["row_weight"] > 0 for mb in microbatches]
    kl = torch.cat([sequence_kl(mb["gen_logprobs"], mb["ref_logprobs"], mb["loss_mask"])[r]
                    for mb, r in zip(microbatches, real)])
    return {"ppo/kl": kl.mean().item(), "ppo/advantage_raw_mean": raw.mean().item(),
            "ppo/return_mean": returns.mean().item(), "ppo/value_old_mean": values.mean().item(),
            # 1 - Var(R - V) / Var(R): how much of the returns' variance V_old explains (1 = all)
            "ppo/explained_variance": (1 - (returns - values).var(unbiased=False)
                                       / returns.var(unbiased=False).clamp(min=1e-8)).item()}


def make_value_loss_fn(clip_eps: float, vf_coef: float):
    """The PPO value model's per-microbatch loss: (values, mb) -> (vf_coef x clipped value loss, metrics)."""
    def value_loss_fn(values: torch.Tensor, mb: dict):
        real = mb["row_weight"] > 0
        loss, m = ppo_value_loss(values[real], mb["old_values"][real], mb["returns"][real], mb["loss_mask"][real],
                                 clip_eps)
        return vf_coef * loss * mb["loss_scale"], m

    return value_loss_fn


def make_loss_fn(algorithm: str, beta: float, dpo_loss_type: str = "sigmoid", clip_eps: float = 0.2,
                 dpo_nll_coef: float = 0.0):
    """The per-microbatch loss for `learner.logprobs.forward_backward`: (logprobs, mb) -> (loss, metrics)."""
    def loss_fn(logprobs: torch.Tensor, mb: dict):
        mask, real = mb["loss_mask"], mb["row_weight"] > 0
        metrics = {}
        if "ref_logprobs" in mb:
            metrics["kl/ref"] = sequence_kl(logprobs.detach(), mb["ref_logprobs"], mask)[real].mean()
        if algorithm == "online_dpo":
            seq, ref = sequence_logprobs(logprobs, mask), sequence_logprobs(mb["ref_logprobs"], mask)
            keep = real[0::2]
            loss, m = dpo_loss(seq[0::2][keep], seq[1::2][keep], ref[0::2][keep], ref[1::2][keep], beta, dpo_loss_type)
            if dpo_nll_coef:  # RPO: + coef * token-mean NLL of the chosen completions
                nll, _ = best_of_k_sft_loss(logprobs[0::2][keep], mask[0::2][keep])
                loss = loss + dpo_nll_coef * nll
                m["loss/chosen_nll"] = nll.detach()
        elif algorithm == "rloo":
            loss, m = rloo_loss(logprobs[real], mask[real], mb["advantages"][real])
        elif algorithm == "proximal_rloo":
            loss, m = proximal_rloo_loss(logprobs[real], mb["gen_logprobs"][real], mask[real],
                                         mb["advantages"][real], clip_eps)
        elif algorithm == "best_of_k_sft":
            loss, m = best_of_k_sft_loss(logprobs[real], mask[real])
        elif algorithm == "ppo":
            loss, m = ppo_policy_loss(logprobs[real], mb["old_logprobs"][real], mb["advantages"][real], mask[real],
                                      clip_eps)
        else:
            raise ValueError(f"unknown algorithm {algorithm!r}")
        if "gen_logprobs" in mb:  # learner vs generator on the trained tokens (drift + numerics)
            diff = (logprobs.detach() - mb["gen_logprobs"]).abs() * mask
            metrics["logprob_diff/learner_vs_generator"] = diff[real].sum() / mask[real].sum().clamp(min=1)
        return loss * mb["loss_scale"], {**m, **metrics}

    return loss_fn
