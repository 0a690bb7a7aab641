"""Megatron DDP wrapping, Adam via `get_megatron_optimizer`, the LR schedule, and one train step.

The model's dtype picks megatron's optimizer (`get_megatron_optimizer`, from the parameters' dtype):
- fp32 params: `FP32Optimizer`, fp32 grads and Adam state (the CPU default);
- bf16 params (GPU; CPU with `model.dtype: bfloat16`, or auto on AMX: run_plan.model_dtype): the
  mixed-precision `Float16OptimizerWithFloat16Params` (the `DistributedOptimizer` on GPU): fp32
  main weights that Adam steps and copies back to the bf16 params, fp32 Adam state, grads
  reduced in fp32 (`grad_reduce_in_fp32`), no loss scaling (bf16). megatron makes the main weights
  from the bf16 params; a fresh learner then sets them from its checkpoint's own values
  (`learner.mapping.load_hf_main_weights`). On CPU megatron-core refuses bf16 params by their
  type's name; `cpu_shims` shows it the CUDA name (see `_cuda_type_names`).
GPU: the DistributedOptimizer (Adam state sharded over DP ranks); grad-reduce / param-gather
overlap per `learner.perf`. CPU: the plain (non-distributed) optimizer.
Gradients are clipped to `clip_grad` (global norm over all TP/PP/DP shards) before each step.

NaN/inf guard: megatron's fp32 and bf16 optimizers step on non-finite gradients (only the fp16
loss scaler checks them). `train_step` checks the reduced gradients in the DDP grad buffers itself
before `optimizer.step()` and agrees on the answer over all learner ranks, so a finite loss with
an inf/NaN gradient skips the step everywhere. (Asking `optimizer.get_grad_norm()` before
`step()` does not work: megatron copies the DDP main grads to where the norm reads them only
inside `step()`, so that norm is 0.0 there.)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from megatron_async.learner.schedule import MB, LossFn, forward_backward
from megatron_async.learner.model import LearnerModel


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


def wrap_ddp(model: LearnerModel) -> LearnerModel:
    """The record with its chunks wrapped in megatron DDP (grads in contiguous fp32 buffers,
    averaged over DP), the grad-sync hooks that `get_forward_backward_func` calls registered on the
    model's config."""
    perf = model.perf
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=perf.overlap_grad_reduce,
        overlap_param_gather=perf.overlap_param_gather,
        use_distributed_optimizer=perf.distributed_optimizer,
    )
    config = get_model_config(model.chunks[0])
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m) for m in model.chunks]
    config.no_sync_func = wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return dataclasses.replace(model, chunks=wrapped)


def build_optimizer(model: LearnerModel, settings: OptimSettings):
    """-> (the record with DDP-wrapped chunks, optimizer, scheduler) for a model from
    `learner.model.build_model`."""
    perf = model.perf
    dtype = next(model.chunks[0].parameters()).dtype
    ddp_model = wrap_ddp(model)
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
        use_distributed_optimizer=perf.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, ddp_model.chunks)
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
    return ddp_model, optimizer, scheduler


def grads_are_finite(ddp_chunks: list) -> bool:
    """True iff every gradient the optimizer would use is finite, on EVERY learner rank.

    Reads the DDP grad buffers (megatron's main grads, after `finalize_model_grads` reduced them
    over DP; with the DistributedOptimizer each rank's buffer holds its reduced shard plus its own
    unreduced grads, and a non-finite local grad makes the reduced one non-finite too). One
    min/max pass per buffer (NaN propagates through both, inf shows in one), then a MAX all-reduce
    of the flag over the default process group (all TP x PP x DP learner ranks), so every rank
    takes the same decision.
    """
    bad, device = [], None
    for chunk in ddp_chunks:
        # megatron DDP keeps its buffers in lists (`buffers` shadows nn.Module.buffers() there)
        buffers = [b for name in ("buffers", "expert_parallel_buffers")
                   if isinstance(getattr(chunk, name, None), list) for b in getattr(chunk, name)]
        grads = [b.grad_data for b in buffers] if buffers else [
            getattr(p, "main_grad", p.grad) for p in chunk.parameters() if p.requires_grad]
        for g in grads:
            if g is None or g.numel() == 0:
                continue
            device = g.device
            lo, hi = torch.aminmax(g)
            bad.append(~(torch.isfinite(lo) & torch.isfinite(hi)))
    if device is None:
        device = next(ddp_chunks[0].parameters()).device
    flag = torch.stack(bad).any().float().reshape(1) if bad else torch.zeros(1, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def train_step(model: LearnerModel, optimizer, scheduler, microbatches: list[MB], loss_fn: LossFn[MB],
               sync_params: bool = True) -> dict[str, float]:
    """One optimizer step over `microbatches` (gradient accumulation across them).

    Returns the loss metrics of `forward_backward` plus "grad_norm" (the global gradient norm
    before clipping, as `optimizer.step()` computes it; NaN when the step was skipped), "lr" (the LR used for this step) and "skipped" (1.0 if the step was not
    taken: NaN/inf loss or gradient, in which case neither the weights, the optimizer state nor the
    LR schedule change), on every rank.

    `sync_params=False` leaves the parameter all-gather of an overlapped DistributedOptimizer
    (`parallel.overlap_param_gather`) to the next forward pass, which then overlaps it; only for a
    step that another training step follows before anything reads the weights.
    """
    ddp_chunks = model.chunks  # wrapped by build_optimizer
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = forward_backward(model, microbatches, loss_fn)
    lr = float(optimizer.param_groups[0]["lr"])
    # The loss is the same on every rank (broadcast); the gradient check is all-reduced: every rank
    # takes the same decision. The collective runs on every rank whatever the loss.
    finite_grads = grads_are_finite(ddp_chunks)
    if not (math.isfinite(metrics["loss"]) and finite_grads):
        metrics.update(grad_norm=math.nan, lr=lr, skipped=1.0)
        return metrics
    ok, grad_norm, _ = optimizer.step()
    if grad_norm is None:  # a bare FP32Optimizer computes the norm only when clipping
        grad_norm = optimizer.get_grad_norm()  # .grad holds the main grads after step()
    if ok:
        scheduler.step(increment=1)
        if sync_params and model.perf.overlap_param_gather:
            for chunk in ddp_chunks:  # weights are read right after a step (sync, checkpoint, export)
                chunk.start_param_sync(force_sync=True)
    metrics.update(grad_norm=float(grad_norm), lr=lr, skipped=0.0 if ok else 1.0)
    return metrics
