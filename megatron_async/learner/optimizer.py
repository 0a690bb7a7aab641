"""Megatron DDP wrapping, Adam via `get_megatron_optimizer`, the LR schedule, and one train step.

CPU: fp32 params, grads and Adam state; plain (non-distributed) optimizer.
GPU: bf16 params with fp32 master weights and fp32 grad reduction; DistributedOptimizer (Adam
state sharded over DP ranks).
Gradients are clipped to `clip_grad` (global norm over all TP/PP/DP shards) before each step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_async.learner.logprobs import LossFn, forward_backward


@dataclass
class OptimSettings:
    """Adam + LR schedule settings (the trainer's config maps onto these)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0  # LR rises linearly from 0 (Megatron's rule: step 1 runs at LR 0)
    decay_steps: int = 1_000_000  # optimizer steps from the end of warmup to min_lr
    decay_style: str = "constant"  # constant | linear | cosine

    def __post_init__(self):
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay_style={self.decay_style!r}: use constant, linear or cosine")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must lie in [0, lr={self.lr}]")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 and decay_steps={self.decay_steps} >= 1")


def wrap_ddp(model_chunks: list) -> list:
    """Wrap model chunks in megatron DDP (grads in contiguous fp32 buffers, averaged over DP) and
    register the grad-sync hooks that `get_forward_backward_func` calls on the model's config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    cuda = torch.cuda.is_available()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cuda,
    )
    config = get_model_config(model_chunks[0])
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m) for m in model_chunks]
    config.no_sync_func = wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(model_chunks: list, settings: OptimSettings):
    """-> (ddp_chunks, optimizer, scheduler) for raw model chunks from `learner.model.build_model`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cuda = torch.cuda.is_available()
    dtype = next(model_chunks[0].parameters()).dtype
    ddp_chunks = wrap_ddp(model_chunks)
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cuda,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=settings.warmup_steps + settings.decay_steps,
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return ddp_chunks, optimizer, scheduler


def train_step(ddp_chunks: list, optimizer, scheduler, microbatches: list[dict], loss_fn: LossFn) -> dict[str, float]:
    """One optimizer step over `microbatches` (gradient accumulation across them).

    Returns the loss metrics of `forward_backward` plus "grad_norm" (before clipping), "lr" (the
    LR used for this step) and "skipped" (1.0 if the step was not taken: NaN/inf loss or gradient
    norm, in which case neither the weights, the optimizer state nor the LR schedule change),
    on every rank.
    """
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = forward_backward(ddp_chunks, microbatches, loss_fn)
    lr = optimizer.param_groups[0]["lr"]
    # NOTE: megatron's fp32 optimizer steps on NaN/inf gradients (only the fp16 loss scaler checks),
    # which would poison the weights. The loss is the same on every rank (broadcast) and the norm
    # is all-reduced, so every rank takes the same decision.
    grad_norm = float(optimizer.get_grad_norm())
    if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
        metrics.update(grad_norm=grad_norm, lr=float(lr), skipped=1.0)
        return metrics
    ok, clipped_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    metrics.update(grad_norm=float(clipped_norm or grad_norm), lr=float(lr), skipped=0.0 if ok else 1.0)
    return metrics
