"""The learner's pass over microbatches through megatron's pipeline schedule.

`forward_backward(model, microbatches, loss_fn)` runs megatron's `get_forward_backward_func()`
(no pipelining, or 1F1B when PP > 1) and, on the last stage, turns the model's output into one
number per token (`learner.logprobs`: logprobs for the policy, values for a value model; the
model's record decides which, `LearnerModel.value_head`, so `learner.optimizer.train_step` serves
both), then calls `loss_fn` on it. `compute_logprobs` and `compute_values` are `forward_backward`
with a loss_fn that records the per-token output, without gradients.

Microbatches are `algorithms.base.Microbatch` records (`input_ids` [b, s], right-padded: causal
attention keeps padding out of real tokens' logprobs; `loss_mask` 1 on the tokens whose output
counts, which are the only nonzero positions `loss_fn` sees; the rest is passed through to
`loss_fn`). Their [b, s] may differ only where the model exchanges shapes between pipeline
stages (`variable_seq_lengths`, `_largest_microbatch`). With sequence parallelism
(`parallel.sequence_parallel`) the model sees input_ids right-padded to a multiple of TP (it
splits the sequence over TP ranks); causal attention keeps the extra positions out of the real
ones, and they are cut off before `loss_fn`, which sees [b, s] as given.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterator, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from typing_extensions import NotRequired, ReadOnly

from megatron_async.learner.lm_head import lm_head
from megatron_async.learner.logprobs import token_logprobs, token_values
from megatron_async.learner.model import LearnerModel, unwrap_model


class Tokens(TypedDict):
    """What the schedule reads of a microbatch; `algorithms.base.Microbatch` is one, and so is a
    plain `{"input_ids": ..., "loss_mask": ...}` (tests, benchmarks). Everything else in the record
    is `loss_fn`'s."""

    input_ids: ReadOnly[torch.Tensor]  # long [b, s], right-padded
    loss_mask: ReadOnly[NotRequired[torch.Tensor]]  # [b, s]: the output is zeroed where it is 0


GPU_SEQ_MULTIPLE = 64  # on GPU a microbatch's length is a multiple of this (microbatch_seq_multiple)


def microbatch_seq_multiple(device: torch.device | str) -> int:
    """What a microbatch's length is rounded up to on `device`. On GPU GPU_SEQ_MULTIPLE: kernels plan
    per shape (cuDNN's fused attention, TE's GEMMs; FP8 GEMMs need multiples of 16), and exact
    lengths make nearly every step a new shape; 64 keeps the shapes to max length / 64. On CPU 1:
    exact lengths, so the CPU results recorded in docs/ do not move."""
    return GPU_SEQ_MULTIPLE if torch.device(device).type == "cuda" else 1


MB = TypeVar("MB", bound=Tokens)  # the microbatch record a call passes through to its loss_fn
Metrics = dict[str, torch.Tensor]
# (per-token logprobs or values [b, s], the microbatch) -> (scalar loss, metrics)
LossFn = Callable[[torch.Tensor, MB], tuple[torch.Tensor, Metrics]]
PerToken = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (stage output, input_ids) -> [b, s]


def _causal_mask(s: int, device: torch.device | str) -> torch.Tensor:
    # megatron convention: True = masked out. Passed explicitly (the default mask is built on CUDA).
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1).view(1, 1, s, s)


def seq_multiple(chunks: list[torch.nn.Module]) -> int:
    """The model's sequence length must be a multiple of this: TP under sequence parallelism, else 1."""
    config = unwrap_model(chunks[0]).config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _forward_step(data_iterator: Iterator[MB], model: torch.nn.Module, *, loss_fn: LossFn[MB],
                  per_token: Callable[[torch.nn.Module], PerToken], multiple: int):
    device = next(model.parameters()).device
    mb = cast(MB, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(data_iterator).items()})
    tokens = mb["input_ids"]
    b, s = tokens.shape
    run_len = -(-s // multiple) * multiple
    if run_len > s:  # sequence parallelism: pad to a multiple of TP; cut off again before the loss
        tokens = torch.nn.functional.pad(tokens, (0, run_len - s))
    position_ids = torch.arange(run_len, device=device).expand(b, run_len)
    output = model(tokens, position_ids, _causal_mask(run_len, device))
    return output, partial(_loss_on_last_stage, mb, tokens, unwrap_model(model), loss_fn=loss_fn, per_token=per_token)


def _loss_on_last_stage(mb: MB, tokens: torch.Tensor, gpt: torch.nn.Module, output: torch.Tensor, *,
                        loss_fn: LossFn[MB], per_token: Callable[[torch.nn.Module], PerToken]):
    s = mb["input_ids"].shape[1]
    out = per_token(gpt)(output, tokens)[:, :s]  # [b, s] logprobs or values (sequence-parallel padding cut off)
    if "loss_mask" in mb:
        out = out * mb["loss_mask"].to(out.dtype)
    loss, metrics = loss_fn(out, mb)
    # The schedule divides the returned loss in place by the number of microbatches: log a clone.
    return loss, {"loss": loss.detach().clone(), **{k: torch.as_tensor(v).detach().float() for k, v in metrics.items()}}


def _largest_microbatch(microbatches: list[MB], chunks: list[torch.nn.Module]) -> tuple[int, int]:
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


def _reduce_metrics(store: list[Metrics], device: torch.device) -> dict[str, float]:
    """Mean over microbatches and DP ranks on the last stage, then broadcast to the whole pipeline."""
    metrics: dict[str, float] | None = None
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
    assert metrics is not None  # set on the last stage, broadcast to the others
    return metrics


def forward_backward(model: LearnerModel, microbatches: list[MB], loss_fn: LossFn[MB], forward_only: bool = False,
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
    chunks = model.chunks

    def per_token(gpt: torch.nn.Module) -> PerToken:  # for this stage's GPTModel
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


def compute_logprobs(model: LearnerModel, microbatches: list[MB], temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token logprobs ([b, s] float32 per microbatch, aligned with input_ids, masked by
    loss_mask) without gradients, on every rank (broadcast from the last pipeline stage)."""
    return _per_token_no_grad(model, microbatches, temperature, values=False)


def compute_values(model: LearnerModel, microbatches: list[MB]) -> list[torch.Tensor]:
    """`compute_logprobs` for a value model (`learner.value`): per-token values V(input_ids[:, :t])."""
    return _per_token_no_grad(model, microbatches, 1.0, values=True)


def _per_token_no_grad(model: LearnerModel, microbatches: list[MB], temperature: float,
                       values: bool) -> list[torch.Tensor]:
    if model.value_head != values:
        raise TypeError(f"compute_{'values' if values else 'logprobs'} got a {'language' if values else 'value'} model")
    collected: list[torch.Tensor] = []

    def record(per_token: torch.Tensor, mb: MB) -> tuple[torch.Tensor, Metrics]:
        collected.append(per_token.detach())
        return per_token.new_zeros(()), {}

    forward_backward(model, microbatches, record, forward_only=True, temperature=temperature)
    return share_with_pipeline(collected, microbatches, next(model.chunks[0].parameters()).device)


def recording(loss_fn: LossFn[MB], store: list[torch.Tensor]) -> LossFn[MB]:
    """`loss_fn` that also appends each microbatch's per-token output (detached, as `loss_fn` gets
    it: masked by loss_mask) to `store`, in microbatch order, on the last pipeline stage; with
    `share_with_pipeline` afterwards, a training pass yields the logprobs `compute_logprobs` would
    have given on the weights it started from."""
    def loss_and_record(per_token: torch.Tensor, mb: MB) -> tuple[torch.Tensor, Metrics]:
        store.append(per_token.detach())
        return loss_fn(per_token, mb)
    return loss_and_record


def share_with_pipeline(collected: list[torch.Tensor], microbatches: list[MB],
                        device: torch.device | str) -> list[torch.Tensor]:
    """Per-token tensors ([b, s] float32 per microbatch) collected on the last pipeline stage,
    broadcast to every stage (a no-op without pipeline parallelism)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if not ps.is_pipeline_last_stage():
            collected = [torch.empty(mb["input_ids"].shape, dtype=torch.float32, device=device) for mb in microbatches]
        for t in collected:
            dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return collected
