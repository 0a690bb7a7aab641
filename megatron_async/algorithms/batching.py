"""Scored completions -> training batches: DPO pairs, RLOO groups, best-of-K selection, padding.

Input records are `megatron_async.sample.Sample`s, one completion of one prompt, as the rollout
scored them. Samples whose reward could not be computed must be removed before this point
(`RolloutBatch.scored`); a missing or non-finite reward here is an error, never a silent 0.

Tensor layout (`collate`), the contract with the learner and the losses:
    input_ids       [B, S] long   prompt + completion, right padded with pad_id (the learner's
                                  attention is causal, so no real token attends to the padding)
    completion_mask [B, S] float  1 on completion tokens (the ones trained on), 0 on prompt/padding
    gen_logprobs    [B, S] float  the generating policy's logprob of input_ids[b, t] at position t
                                  (0 off the completion mask); None when samples carry none
Logprobs are TARGET-aligned: position t holds log p(input_ids[b, t] | input_ids[b, :t]). A
learner computing logits[:, t] (which predict token t + 1) shifts by one to match:
logp[:, 1:] = log_softmax(logits[:, :-1]).gather(input_ids[:, 1:]). Position 0 is always a prompt
token, so it is never on the mask.

Sequence packing (no padding, cu_seqlens) is not implemented: batches are padded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from megatron_async.sample import Sample


@dataclass
class TrainBatch:
    """Padded tensors of B samples (layout in the module docstring)."""

    input_ids: torch.Tensor
    completion_mask: torch.Tensor
    gen_logprobs: torch.Tensor | None
    rewards: torch.Tensor  # [B] float


def _reward(s: Sample) -> float:
    """The sample's reward: a finite number by now, or a ValueError (a failure is never a reward)."""
    if s.reward is None or not math.isfinite(s.reward):
        raise ValueError(
            f"sample of prompt {s.prompt_index} has reward {s.reward!r}: drop failed samples "
            "(RolloutBatch.scored()) before batching; a failure is never a reward"
        )
    return float(s.reward)


def group_by_prompt(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    """prompt_index -> its samples, prompts in first-seen order, samples in input order."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        _reward(s)
        groups.setdefault(s.prompt_index, []).append(s)
    return groups


def build_dpo_pairs(samples: Iterable[Sample]) -> tuple[list[tuple[Sample, Sample]], dict[str, float]]:
    """Per prompt with >= 2 samples: (best, worst) by reward -> ([(chosen, rejected)], stats).

    A prompt whose best and worst rewards are equal (all tied) carries no preference and is
    skipped and counted (a peer's trainer that treats the first of a tied pair as chosen saw its
    held-out accuracy FALL). With several samples at the top (or bottom) reward the first one
    in input order is taken, which is deterministic and unbiased since sampling order is random.
    """
    pairs, ties, too_few, gaps = [], 0, 0, []
    for group in group_by_prompt(samples).values():
        if len(group) < 2:
            too_few += 1
            continue
        best = max(group, key=_reward)  # first maximal
        worst = min(group, key=_reward)  # first minimal
        if best.reward == worst.reward:
            ties += 1
            continue
        pairs.append((best, worst))
        gaps.append(_reward(best) - _reward(worst))
    stats = {
        "dpo/pairs": float(len(pairs)),
        "dpo/tied_prompts": float(ties),
        "dpo/too_few_samples": float(too_few),
        "dpo/reward_gap": sum(gaps) / len(gaps) if gaps else 0.0,
    }
    return pairs, stats


def group_samples(samples: Iterable[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
    """Complete groups of exactly k samples per prompt, laid out contiguously (RLOO / PPO).

    A prompt with fewer than k samples (some dropped for a failed reward) is left out and
    counted: RLOO's leave-one-out baseline assumes k per group. More than k is an upstream bug.
    Prompts whose k rewards are all equal are kept (advantage 0) and counted, for logging.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out, incomplete, flat = [], 0, 0
    for prompt_index, group in group_by_prompt(samples).items():
        if len(group) > k:
            raise ValueError(f"prompt {prompt_index} has {len(group)} samples, more than k={k}")
        if len(group) < k:
            incomplete += 1
            continue
        flat += len({s.reward for s in group}) == 1
        out.extend(group)
    return out, {"group/incomplete_prompts": float(incomplete), "group/zero_variance_prompts": float(flat)}


def select_best_of_k(samples: Iterable[Sample], min_reward: float | None = None) -> tuple[list[Sample], dict[str, float]]:
    """Best-of-K SFT selection: the highest-reward sample of each prompt (first on ties).

    `min_reward` drops prompts whose best is below it: with 0/1 exact-match rewards set it to 1.0,
    or an all-wrong group would be trained on as if it were a good answer.
    """
    chosen, below, tied = [], 0, 0
    for group in group_by_prompt(samples).values():
        best = max(group, key=_reward)
        tied += len(group) > 1 and all(s.reward == best.reward for s in group)
        if min_reward is not None and _reward(best) < min_reward:
            below += 1
            continue
        chosen.append(best)
    return chosen, {"sft/selected": float(len(chosen)), "sft/below_min_reward": float(below), "sft/tied_prompts": float(tied)}


def collate(samples: Sequence[Sample], pad_id: int, pad_to_multiple_of: int = 1) -> TrainBatch:
    """Right-pad samples into a TrainBatch. S = longest prompt + completion, rounded up to a
    multiple of `pad_to_multiple_of` (e.g. TP size under sequence parallelism)."""
    if not samples:
        raise ValueError("collate: no samples")
    with_lp = [s.logprobs is not None for s in samples]
    if any(with_lp) and not all(with_lp):
        raise ValueError("collate: some samples have generating logprobs and some do not")
    for s in samples:
        if len(s.token_ids) == 0 or len(s.prompt_token_ids) == 0:
            raise ValueError(f"sample of prompt {s.prompt_index}: empty prompt or completion, nothing to train on")
        if s.logprobs is not None and len(s.logprobs) != len(s.token_ids):
            raise ValueError(f"sample of prompt {s.prompt_index}: {len(s.logprobs)} logprobs for {len(s.token_ids)} completion tokens")
    lengths = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
    S = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(B, S)
    gen_logprobs = torch.zeros(B, S) if all(with_lp) else None
    for b, s in enumerate(samples):
        p, n = len(s.prompt_token_ids), lengths[b]
        input_ids[b, :p] = torch.tensor(list(s.prompt_token_ids), dtype=torch.long)
        input_ids[b, p:n] = torch.tensor(list(s.token_ids), dtype=torch.long)
        completion_mask[b, p:n] = 1.0
        if gen_logprobs is not None and s.logprobs is not None:  # all samples have them
            gen_logprobs[b, p:n] = torch.tensor(list(s.logprobs), dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        completion_mask=completion_mask,
        gen_logprobs=gen_logprobs,
        rewards=torch.tensor([_reward(s) for s in samples]),
    )

