"""Per-token log-probabilities (or values) and losses through megatron's pipeline schedules.

One path serves all: `forward_backward(model, microbatches, loss_fn)` runs megatron's
`get_forward_backward_func()` (no pipelining, or 1F1B when PP > 1) and, on the last stage, turns
the model's output into one number per token, then calls `loss_fn` on it. For the policy that is
the logprob of each token: the model returns its final hidden states (its LM head is deferred,
`learner.lm_head`) and `token_logprobs` projects them to vocab-parallel logits, all at once or a
chunk of tokens at a time (`trainer.logits_chunk_mb`), through megatron's
`vocab_parallel_cross_entropy` (full-vocabulary logits are never gathered); for a PPO value model
(`learner.value`) it is the value of the state each token was generated from. The model's record
decides which (`LearnerModel.value_head`), so `learner.optimizer.train_step` serves both. `compute_logprobs` and
`compute_values` are `forward_backward` with a loss_fn that records the per-token output.

Microbatch contract: a dict with
  "input_ids": LongTensor [b, s], right-padded (causal attention keeps padding out of real
               tokens' logprobs);
  "loss_mask": optional [b, s], 1 for tokens whose logprob counts (completion), 0 for prompt and
               padding;
  any other keys, passed through to `loss_fn` (advantages, reference logprobs, ...).
All microbatches of one call share the same [b, s] (pipeline p2p buffers have a fixed shape).
With sequence parallelism (`parallel.sequence_parallel`) the model sees input_ids right-padded to a
multiple of TP (it splits the sequence over TP ranks); causal attention keeps the extra positions
out of the real ones, and they are cut off before `loss_fn`, which sees [b, s] as given.
Logprobs are aligned with input_ids: `logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`,
`logprobs[:, 0] = 0`, and positions where loss_mask is 0 are 0. Values likewise:
`values[:, t] = V(input_ids[:, :t])`, the state token t was sampled in (TRL's alignment).

Vocabulary padding (`LearnerModel.padded_vocab_size`): the logits have padded_vocab_size / TP
columns per rank; those of the padding rows (>= the HF vocab_size) are set to -inf before the
log-softmax (`mask_vocab_padding`), so logprobs over the real vocabulary are exactly an unpadded
model's and the padding rows get no gradient.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from megatron_async.learner.lm_head import LMHead, lm_head
from megatron_async.learner.model import LearnerModel, unwrap_model, vocab_shard_real_rows

LossFn = Callable[[torch.Tensor, dict], "tuple[torch.Tensor, dict]"]


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
        from megatron.core import parallel_state as ps

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
        # contiguous: a GEMM on the strided view is several times slower on CPU (measured 4.5x)
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
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

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
    from megatron.core import parallel_state as ps

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


def _causal_mask(s: int, device) -> torch.Tensor:
    # megatron convention: True = masked out. Passed explicitly (the default mask is built on CUDA).
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)


def seq_multiple(chunks: list) -> int:
    """The model's sequence length must be a multiple of this: TP under sequence parallelism, else 1."""
    config = unwrap_model(chunks[0]).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _forward_step(data_iterator, model, *, loss_fn: LossFn, per_token: Callable, multiple: int):
    mb = next(data_iterator)
    device = next(model.parameters()).device
    mb = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
    tokens = mb["input_ids"]
    b, s = tokens.shape
    run_len = -(-s // multiple) * multiple
    if run_len > s:  # sequence parallelism: pad to a multiple of TP; cut off again before the loss
        tokens = torch.nn.functional.pad(tokens, (0, run_len - s))
    position_ids = torch.arange(run_len, device=device).expand(b, run_len)
    output = model(tokens, position_ids, _causal_mask(run_len, device))
    return output, partial(_loss_on_last_stage, mb, tokens, unwrap_model(model), loss_fn=loss_fn, per_token=per_token)


def _loss_on_last_stage(mb: dict, tokens: torch.Tensor, gpt, output: torch.Tensor, *, loss_fn: LossFn,
                        per_token: Callable):
    s = mb["input_ids"].shape[1]
    out = per_token(gpt)(output, tokens)[:, :s]  # [b, s] logprobs or values (sequence-parallel padding cut off)
    if "loss_mask" in mb:
        out = out * mb["loss_mask"].to(out.dtype)
    loss, metrics = loss_fn(out, mb)
    # The schedule divides the returned loss in place by the number of microbatches: log a clone.
    metrics = {"loss": loss.detach().clone(), **{k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}}
    return loss, metrics


def _largest_microbatch(microbatches: list[dict], chunks) -> tuple[int, int]:
    """[batch, seq] of the largest microbatch. Shapes may differ (trainer.micro_batch_tokens) where
    the model's config exchanges them between pipeline stages (`variable_seq_lengths`, on for PP > 1)."""
    if not microbatches:
        raise ValueError("no microbatches")
    shapes = {tuple(mb["input_ids"].shape) for mb in microbatches}
    config = unwrap_model(chunks[0]).config
    if len(shapes) > 1 and config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths:
        raise ValueError(f"microbatches of different [batch, seq] shapes {sorted(shapes)} need the model's "
                         f"variable_seq_lengths under pipeline parallelism (learner/model.py)")
    return max(b for b, _ in shapes), max(s for _, s in shapes)


def _reduce_metrics(store: list[dict], device) -> dict[str, float]:
    """Mean over microbatches and DP ranks on the last stage, then broadcast to the whole pipeline."""
    from megatron.core import parallel_state as ps

    metrics = None
    if ps.is_pipeline_last_stage():
        keys = sorted(store[0])
        values = torch.stack([torch.stack([m[k].to(device).float().reshape(()) for k in keys]) for m in store]).mean(0)
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(values, group=ps.get_data_parallel_group())
            values /= ps.get_data_parallel_world_size()
        metrics = dict(zip(keys, values.tolist()))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [metrics]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        metrics = box[0]
    return metrics


def forward_backward(model: LearnerModel, microbatches: list[dict], loss_fn: LossFn, forward_only: bool = False,
                     temperature: float = 1.0) -> dict[str, float]:
    """Run forward (and backward unless `forward_only`) over `microbatches` with megatron's schedule.

    `loss_fn(logprobs [b, s], microbatch) -> (scalar loss, metrics dict)` runs on the last pipeline
    stage for each microbatch (a value model passes values [b, s] instead of logprobs). Gradients
    accumulate as the mean of the per-microbatch losses (and, under megatron DDP, over DP ranks).
    Returns the metrics averaged over microbatches and DP ranks, with the loss under "loss", on
    EVERY rank. For training, `model` must be the record `learner.optimizer.build_optimizer`
    returned (its chunks carry the grad-sync hooks); call `optimizer.step()` afterwards and zero
    the grads before the next call.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model.chunks

    def per_token(gpt) -> Callable:  # (GPTModel output, input_ids) -> [b, s], for this stage's GPTModel
        if model.value_head:
            return token_values
        return partial(token_logprobs, head=lm_head(gpt), temperature=temperature,
                       vocab_size=model.arch.vocab_size,  # padding rows masked
                       chunk_bytes=model.logits_chunk_bytes)

    b, s = _largest_microbatch(microbatches, chunks)
    multiple = seq_multiple(chunks)
    run_len = -(-s // multiple) * multiple  # the schedule's seq_length: p2p shapes where they do not vary
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_ctx:
        store = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn=loss_fn, per_token=per_token, multiple=multiple),
            data_iterator=iter(microbatches),
            model=chunks,
            num_microbatches=len(microbatches),
            seq_length=run_len,
            micro_batch_size=b,
            forward_only=forward_only,
        )
    return _reduce_metrics(store, next(chunks[0].parameters()).device)


def compute_logprobs(model: LearnerModel, microbatches: list[dict], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token logprobs ([b, s] float32 per microbatch, aligned with input_ids, masked by
    loss_mask) without gradients, on every rank (broadcast from the last pipeline stage)."""
    return _per_token_no_grad(model, microbatches, temperature, values=False)


def compute_values(model: LearnerModel, microbatches: list[dict]) -> list[torch.Tensor]:
    """`compute_logprobs` for a value model (`learner.value`): per-token values V(input_ids[:, :t])."""
    return _per_token_no_grad(model, microbatches, 1.0, values=True)


def _per_token_no_grad(model: LearnerModel, microbatches: list[dict], temperature: float,
                       values: bool) -> list[torch.Tensor]:
    if model.value_head != values:
        raise TypeError(f"compute_{'values' if values else 'logprobs'} got a {'language' if values else 'value'} model")
    collected = []

    def record(per_token, mb):
        collected.append(per_token.detach())
        return per_token.new_zeros(()), {}

    forward_backward(model, microbatches, record, forward_only=True, temperature=temperature)
    return share_with_pipeline(collected, microbatches, next(model.chunks[0].parameters()).device)


def recording(loss_fn: LossFn, store: list) -> LossFn:
    """`loss_fn` that also appends each microbatch's per-token output (detached, as `loss_fn` gets
    it: masked by loss_mask) to `store`, in microbatch order, on the last pipeline stage; with
    `share_with_pipeline` afterwards, a training pass yields the logprobs `compute_logprobs` would
    have given on the weights it started from."""
    def loss_and_record(per_token, mb):
        store.append(per_token.detach())
        return loss_fn(per_token, mb)
    return loss_and_record


def share_with_pipeline(collected: list[torch.Tensor], microbatches: list[dict], device) -> list[torch.Tensor]:
    """Per-token tensors ([b, s] float32 per microbatch) collected on the last pipeline stage,
    broadcast to every stage (a no-op without pipeline parallelism)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        if not ps.is_pipeline_last_stage():
            collected = [torch.empty(mb["input_ids"].shape, dtype=torch.float32, device=device) for mb in microbatches]
        for t in collected:
            dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return collected
