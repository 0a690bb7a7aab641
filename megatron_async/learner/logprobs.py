"""Per-token log-probabilities and values from the model's output: the maths of the last stage.

The schedule (`learner.schedule.forward_backward`) calls these on the last pipeline stage. For
the policy, `token_logprobs` turns the model's final hidden states (its LM head is deferred,
`learner.lm_head`) into the logprob of each token: it projects them to vocab-parallel logits, all
at once or a chunk of tokens at a time (`trainer.logits_chunk_mb`), through megatron's
`vocab_parallel_cross_entropy` (full-vocabulary logits are never gathered); for a PPO value model
(`learner.value`) `token_values` gives the value of the state each token was generated from.

Alignment: `logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`, `logprobs[:, 0] = 0`;
`values[:, t] = V(input_ids[:, :t])`, the state token t was sampled in (TRL's alignment).

Vocabulary padding (`LearnerModel.padded_vocab_size`): the logits have padded_vocab_size / TP
columns per rank; those of the padding rows (>= the HF vocab_size) are set to -inf before the
log-softmax (`mask_vocab_padding`), so logprobs over the real vocabulary are exactly an unpadded
model's and the padding rows get no gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from megatron_async.learner.lm_head import LMHead
from megatron_async.learner.model import vocab_shard_real_rows

def mask_vocab_padding(logits: torch.Tensor, vocab_size: int | None, tp: int | None = None,
                       rank: int | None = None) -> torch.Tensor:
    """Set, IN PLACE, this TP rank's logits of padded vocabulary rows (>= `vocab_size`) to -inf.

    `logits`: [..., padded_vocab / TP], TP rank `rank`'s contiguous slice of the vocabulary
    (megatron's vocab-parallel split; `tp`, `rank` default to megatron's parallel_state). None or
    no padding on this rank: returned unchanged. A rank may hold no real row at all (all -inf): the
    vocab-parallel max is taken over all ranks and stays finite, so no NaN appears."""
    if vocab_size is None:
        return logits
    if tp is None or rank is None:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    padded = logits.shape[-1] * tp
    if padded < vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} x tp={tp} vocabulary columns, fewer than vocab_size={vocab_size}")
    real = vocab_shard_real_rows(vocab_size, padded, tp, rank)
    if real < logits.shape[-1]:
        logits[..., real:] = float("-inf")
    return logits


def token_logprobs(hidden: torch.Tensor, input_ids: torch.Tensor, head: LMHead, temperature: float = 1.0,
                   vocab_size: int | None = None, chunk_bytes: int = 0) -> torch.Tensor:
    """[b, s, hidden] final hidden states -> [b, s] logprobs of each token given its prefix.

    `hidden`: GPTModel's output with its LM head deferred (`learner.lm_head`; under sequence
    parallelism this rank's [b, s / TP, hidden]); `head` projects them to vocab-parallel logits.
    `vocab_size`: the real (HF) vocabulary; the logits of padded rows beyond it are masked out.
    `chunk_bytes` (`LearnerModel.logits_chunk_bytes`; 0 = all at once): the logits are made at most
    that many fp32 bytes at a time, in chunks of positions, or under sequence parallelism of rows
    (the projection gathers the sequence). With gradients, each chunk is recomputed in the backward
    (activation checkpointing) when there is more than one, so only one chunk's logits, softmax and
    gradient exist at a time; one chunk is computed once."""
    h = hidden.transpose(0, 1)  # [s, b, hidden]: megatron's layout, the projection's input (a view)
    # position t scores token t + 1; the last position gets a placeholder target (0), dropped below
    target = torch.nn.functional.pad(input_ids[:, 1:], (0, 1)).t()  # [s, b]
    dim = 1 if head.sequence_parallel else 0
    tokens_per_slice = target.shape[1 - dim]
    n = h.shape[dim]
    step = n if chunk_bytes <= 0 else max(1, chunk_bytes // (tokens_per_slice * head.vocab_per_rank * 4))
    pieces = []
    for start in range(0, n, step):
        size = min(step, n - start)
        # contiguous: a GEMM on the strided view is several times slower on CPU
        h_chunk, target_chunk = h.narrow(dim, start, size).contiguous(), target.narrow(dim, start, size).contiguous()
        if not torch.is_grad_enabled():  # reference / old-policy logprobs: nothing to keep for a backward
            pieces.append(_chunk_logprobs_no_grad(head(h_chunk), target_chunk, temperature, vocab_size))
        elif step >= n:
            pieces.append(_chunk_logprobs(h_chunk, target_chunk, head, temperature, vocab_size))
        else:
            pieces.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h_chunk, target_chunk, head, temperature,
                                                            vocab_size, use_reentrant=False))
    logprobs = torch.cat(pieces, dim).t()  # [b, s]: position t scores token t + 1
    return torch.nn.functional.pad(logprobs[:, :-1], (1, 0))


def _chunk_logprobs(hidden: torch.Tensor, target: torch.Tensor, head: LMHead, temperature: float,
                    vocab_size: int | None) -> torch.Tensor:
    """[s', b', hidden] hidden states and [s', b'] targets -> [s', b'] log p(target), differentiably.

    megatron's `vocab_parallel_cross_entropy` works IN PLACE on its input (it subtracts the max,
    exponentiates and normalises there, and keeps the result for its backward); it gets the
    projection's own fp32 logits, as megatron's language-model loss does (a copy only for bf16)."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits.div_(temperature)
    mask_vocab_padding(logits, vocab_size)
    return -vocab_parallel_cross_entropy(logits, target)


def _chunk_logprobs_no_grad(logits: torch.Tensor, target: torch.Tensor, temperature: float,
                            vocab_size: int | None) -> torch.Tensor:
    """[s', b', vocab / TP] logits and [s', b'] targets -> [s', b'] log p(target), without autograd,
    in three passes over the logits instead of ~nine, in place (it consumes `logits`).

    megatron's `vocab_parallel_cross_entropy` is built for training: it normalises the whole
    softmax to keep it for the backward. A forward-only pass needs only log p(target) =
    logit[target] - max - log(sum(exp(logit - max))), the max, the sum and the target's logit
    all-reduced over the TP group as megatron does; padded vocabulary rows are left out by slicing
    this rank's real columns (no copy, no -inf fill).
    """
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    per_rank = logits.shape[-1]
    real = per_rank if vocab_size is None else vocab_shard_real_rows(vocab_size, per_rank * tp, tp, rank)
    own = logits[..., :real].float()  # a view in fp32 (a copy for bf16), worked on in place below
    if temperature != 1.0:
        own.div_(temperature)
    local = target - rank * per_rank
    on_rank = (local >= 0) & (local < real)
    logits_max = own.amax(-1) if real else torch.full(target.shape, float("-inf"), device=logits.device)
    predicted = own.gather(-1, local.clamp(0, max(real - 1, 0))[..., None])[..., 0] if real else torch.zeros_like(logits_max)
    predicted = torch.where(on_rank, predicted, torch.zeros_like(predicted))
    if group is not None:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = own.sub_(logits_max[..., None]).exp_().sum(-1)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(predicted, group=group)
    return predicted - logits_max - sum_exp.log()


def token_values(output: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s, 1] value-head output -> [b, s] values aligned like logprobs: position t gets the
    value of the prefix before token t (the head's output at t - 1); position 0 gets 0."""
    return torch.nn.functional.pad(output[:, :-1, 0].float(), (1, 0))
