"""The learner on every rank: its models and optimizers, and one learner step on a scored batch.

    learner = LearnerState.build(cfg, plan, init_model, layout, pad_id)   # policy, reference, optimizer, ...
    metrics = learner.step(batch, step)     # the algorithm's N minibatches x T passes; version -> step + 1

The algorithm (`algorithms/`) decides which samples are trained on, what each batch needs (the
reference's and, for PPO, the old policy's logprobs and values: this object answers those
forward passes, as `algorithms.LearnerModels`) and the loss; this module only runs it on the
megatron-core learner. Every rank of the TP x PP x DP grid holds one and runs the same step.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_async.algorithms import Algorithm, build_algorithm, dp_shard, split_units
from megatron_async.algorithms.base import Microbatch, attach
from megatron_async.config import Config, ConfigError
from megatron_async.learner.schedule import (LossFn, compute_logprobs, compute_values, microbatch_seq_multiple, recording,
                                             share_with_pipeline)
from megatron_async.learner.mapping import load_hf_main_weights, load_hf_weights
from megatron_async.learner.model import LearnerModel, build_model, read_arch
from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
from megatron_async.learner.parallel import ParallelLayout
from megatron_async.learner.perf import PerfSettings
from megatron_async.learner.value import build_value_model
from megatron_async.rollout.producer import RolloutBatch
from megatron_async.run import faults
from megatron_async.run_plan import RunPlan

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

log = logging.getLogger(__name__)


@dataclass
class Trainable:
    """A model (its chunks megatron-DDP-wrapped) with its optimizer and LR schedule."""

    model: LearnerModel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler

    def train_step(self, microbatches: list[Microbatch], loss_fn: LossFn[Microbatch],
                   sync_params: bool = True) -> dict[str, float]:
        """One optimizer step over `microbatches` (`learner.optimizer.train_step`; `sync_params=False`
        leaves an overlapped parameter gather running into the next step)."""
        return train_step(self.model, self.optimizer, self.scheduler, microbatches, loss_fn, sync_params=sync_params)


@dataclass
class LearnerState:
    cfg: Config
    layout: ParallelLayout
    algorithm: Algorithm
    policy: Trainable
    reference: LearnerModel  # frozen: the policy RL started from
    value: Trainable | None  # PPO's value model (learner/value.py); None for algorithms without one
    pad_id: int
    version: int = 0  # policy version of the weights = learner steps done

    @classmethod
    def build(cls, cfg: Config, plan: RunPlan, init_model: Path, layout: ParallelLayout, pad_id: int) -> "LearnerState":
        """This rank's learner from the HF checkpoint RL starts from (the SFT model, if any)."""
        t = cfg.trainer
        algorithm = build_algorithm(cfg)
        value_from_rm = algorithm.value_model and cfg.reward.kind == "reward_model"
        if value_from_rm:
            check_value_model_source(cfg, init_model)
        optim_steps = t.steps * t.minibatches * t.updates_per_batch
        settings = OptimSettings(lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                                 adam_beta2=t.adam_beta2, clip_grad=t.grad_clip, warmup_steps=t.warmup_steps,
                                 decay_steps=max(1, optim_steps - t.warmup_steps), decay_style=t.lr_decay)
        perf = PerfSettings.from_config(cfg.parallel)  # parallel.* GPU settings, resolved per model (learner/perf.py)
        backend = plan.backend  # the device and fused kernels they are resolved against (run_plan.py)
        vocab_pad = cfg.model.make_vocab_size_divisible_by  # learner/model.py: vocabulary padding
        chunk_bytes = t.logits_chunk_mb << 20  # learner/lm_head.py: 0 = each microbatch's logits at once
        shapes_vary = t.micro_batch_tokens > 0  # a token budget's microbatches differ in shape (learner/model.py)
        if layout.rank == 0:
            log.info("learner: %s (%s)", plan.model_dtype, plan.model_dtype_why)
        dtype = plan.torch_dtype  # bf16: fp32 main weights in the optimizer (learner/optimizer.py)
        policy = build_model(init_model, dtype=dtype, perf=perf, backend=backend,
                             make_vocab_size_divisible_by=vocab_pad, logits_chunk_bytes=chunk_bytes,
                             shapes_vary=shapes_vary)
        load_hf_weights(policy, init_model)
        reference = build_model(init_model, dtype=dtype, perf=perf, backend=backend,
                                make_vocab_size_divisible_by=vocab_pad, logits_chunk_bytes=chunk_bytes,
                                shapes_vary=shapes_vary)
        load_hf_weights(reference, init_model)
        for chunk in reference.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        value = None
        if algorithm.value_model:  # starts from the reward model if there is one, else the policy
            value_init = cfg.reward.model_path if value_from_rm else init_model
            value_model = build_value_model(value_init, from_reward_model=value_from_rm, dtype=dtype, perf=perf,
                                            backend=backend, make_vocab_size_divisible_by=vocab_pad,
                                            shapes_vary=shapes_vary)
            value_lr = t.value_lr or t.lr  # the policy's schedule shape, scaled to value_lr
            value = Trainable(*build_optimizer(value_model, dataclasses.replace(settings, lr=value_lr,
                                                                           min_lr=t.min_lr * value_lr / t.lr)))
            load_hf_main_weights(value.model, value.optimizer, value_init, score_head=value_from_rm)
        trainable = Trainable(*build_optimizer(policy, settings))
        if load_hf_main_weights(trainable.model, trainable.optimizer, init_model) and layout.rank == 0:
            log.info("learner: fp32 main weights from %s's own values, not from their bf16 rounding", init_model)
        return cls(cfg, layout, algorithm, trainable, reference, value, pad_id)

    # -- algorithms.LearnerModels: the forward passes a batch's preparation asks for ---------------
    def reference_logprobs(self, microbatches: list[Microbatch]) -> list[torch.Tensor]:
        return compute_logprobs(self.reference, microbatches)

    def policy_logprobs(self, microbatches: list[Microbatch]) -> list[torch.Tensor]:
        return compute_logprobs(self.policy.model, microbatches)

    def values(self, microbatches: list[Microbatch]) -> list[torch.Tensor]:
        if self.value is None:
            raise TypeError(f"{self.algorithm.name} has no value model")
        return compute_values(self.value.model, microbatches)

    # -- one learner step ------------------------------------------------------------------------
    def step(self, batch: RolloutBatch, step: int, updates: int) -> dict[str, float]:
        """Train on batch `step`: N minibatches (optimizer steps) x T = `updates` passes. Same on every rank."""
        t, algo = self.cfg.trainer, self.algorithm
        k = batch.k  # K of this batch (trainer.auto_balance may change it between batches)
        samples = batch.scored()
        rows, metrics = algo.select(samples, k)
        versions = [s.policy_version for s in samples]
        metrics.update({"rollout/lag_mean": step - sum(versions) / max(1, len(versions)),
                        "rollout/lag_max": float(step - min(versions, default=step)),
                        "rollout/policy_version": float(batch.policy_version)})
        self.version = step + 1
        if not rows:
            log.warning("step %d: nothing to train on (all prompts tied or dropped)", step)
            return metrics
        # N minibatches per batch; within each, this DP rank's share. Units (a DPO pair, a group of
        # K) are never split.
        parts = [dp_shard(part, algo.unit(k), self.layout.dp, self.layout.dp_rank)
                 for part in split_units(rows, algo.unit(k), t.minibatches)]
        metrics.update({"train/rows": float(len(rows)), "train/rows_this_dp_rank": float(sum(map(len, parts))),
                        # prompt + completion tokens, counted once per pass (not the microbatches' padding)
                        "train/tokens": float(updates * sum(len(r.prompt_token_ids) + len(r.token_ids) for r in rows))})
        minibatches = [algo.microbatches(part, self.pad_id, t.micro_batch_size, self.layout.device, t.micro_batch_tokens,
                                         seq_multiple=microbatch_seq_multiple(self.layout.device)) for part in parts]
        real_tokens = sum(len(r.prompt_token_ids) + len(r.token_ids) for part in parts for r in part)
        metrics["train/padding_fraction"] = 1 - real_tokens / sum(mb["input_ids"].numel() for mbs in minibatches for mb in mbs)
        # One optimizer step: the staleness monitor reads the learner's logprobs off its training forward
        old_from_training = algo.monitor_from_training(minibatches, updates)
        metrics.update({key: float(v) for key, v in algo.prepare(minibatches, self, k, old_from_training).items()})
        loss_fn = faults.poison_loss_at(step, algo.loss)
        trained_logprobs: list[torch.Tensor] = []
        if old_from_training:
            loss_fn = recording(loss_fn, trained_logprobs)
        policy_metrics, value_metrics = [], []
        value_loss = algo.value_loss
        if self.value is not None and value_loss is None:
            raise TypeError(f"{algo.name} has a value model but no value_loss")
        last = updates * len(minibatches) - 1
        for i, mbs in enumerate(mbs for _ in range(updates) for mbs in minibatches):  # T passes x N optimizer steps
            # NOTE the weights are read (weight push) only after the batch's last step: the parameter
            # gather of earlier steps may overlap the next step's forward (parallel.overlap_param_gather)
            policy_metrics.append(self.policy.train_step(mbs, loss_fn, sync_params=i == last))
            if self.value is not None and value_loss is not None:
                value_metrics.append(self.value.train_step(mbs, value_loss, sync_params=i == last))
        if old_from_training:
            (mbs,) = minibatches
            attach(mbs, "old_logprobs", share_with_pipeline(trained_logprobs, mbs, self.layout.device))
            metrics.update({key: float(v) for key, v in algo.staleness(minibatches).items()})
        return {**metrics, **mean_metrics(policy_metrics, "train/"), **mean_metrics(value_metrics, "train_value/")}


def check_value_model_source(cfg: Config, init_model: Path) -> None:
    """PPO's value model starts from the reward model and reads the policy's token ids: their
    vocabularies must match (checked before anything is built)."""
    rm_vocab, vocab = read_arch(cfg.reward.model_path).vocab_size, read_arch(init_model).vocab_size
    if rm_vocab != vocab:
        raise ConfigError(f"key 'reward.model_path' = {cfg.reward.model_path!r}: vocab_size={rm_vocab}, the "
                          f"policy's is {vocab}; PPO's value model starts from the reward model and reads "
                          f"the policy's token ids, so they must share a tokenizer")


def mean_metrics(per_step: list[dict], prefix: str) -> dict[str, float]:
    """Mean over optimizer steps of each metric; names without a namespace get `prefix`."""
    return {(key if "/" in key else prefix + key): sum(m[key] for m in per_step) / len(per_step)
            for key in (per_step[0] if per_step else {})}
