"""Supervised warm-up before RL: the learner trains on reference solutions, then exports HF.

The CPU main job starts from a randomly initialised tiny LLaMA, which must first learn the answer
format before exact-match rewards can say anything; the paper likewise starts RL from an SFT
model. The same megatron learner, loss path and microbatching as RL are used (Best-of-K SFT's NLL
on the reference solution + EOS). The result, `<run dir>/sft_model`, is policy version 0: the
replicas start from it and the frozen reference model is loaded from it. A run that finds it
already there (a resumed or repeated run) reuses it.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

from megatron_async.algorithms.best_of_k_sft import BestOfKSFT
from megatron_async.config import Config
from megatron_async.data import PromptIterator, load_train_prompts
from megatron_async.learner.hf_export import export_hf
from megatron_async.learner.mapping import load_hf_main_weights, load_hf_weights
from megatron_async.learner.model import build_model
from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
from megatron_async.learner.parallel import ParallelLayout
from megatron_async.learner.perf import PerfSettings
from megatron_async.learner.schedule import microbatch_seq_multiple
from megatron_async.observability.tracking import Tracker
from megatron_async.run_plan import RunPlan
from megatron_async.sample import Sample

log = logging.getLogger(__name__)


def sft_rows(prompts, tokenizer) -> list[Sample]:
    """Prompt ids + (" " + reference solution + EOS) as one training row per problem; a chat prompt
    (data.chat_template) ends in the assistant's turn header, so its solution has no leading space
    (EOS is the template's end of turn for instruct tokenizers such as SmolLM2's <|im_end|>)."""
    rows = []
    for i, p in enumerate(prompts):
        sep = "" if p.messages is not None else " "
        target = tokenizer(sep + p.problem.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(Sample(prompt_index=i, prompt_token_ids=p.ids, token_ids=target, logprobs=None, reward=1.0,
                           policy_version=0))
    return rows


def run_sft(cfg: Config, plan: RunPlan, base: Path, tokenizer, layout: ParallelLayout, tracker: Tracker) -> Path:
    """`sft.steps` steps on the train split's reference solutions from `base`; -> the SFT model's HF dir."""
    out = cfg.run_dir / "sft_model"
    if (out / "config.json").exists():
        log.info("SFT model found at %s: reusing it", out)
        return out
    s = cfg.sft
    model = build_model(base, dtype=plan.torch_dtype,  # the RL learner's (learner_state.py)
                        perf=PerfSettings.from_config(cfg.parallel), backend=plan.backend,
                        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    load_hf_weights(model, base)
    settings = OptimSettings(lr=s.lr, min_lr=s.lr / 10, clip_grad=1.0, warmup_steps=min(20, s.steps // 10),
                             decay_steps=max(1, s.steps - min(20, s.steps // 10)), decay_style="cosine")
    policy, optimizer, scheduler = build_optimizer(model, settings)
    load_hf_main_weights(policy, optimizer, base)  # bf16: not rounded first
    prompts, _ = load_train_prompts(cfg, tokenizer)
    data = PromptIterator(prompts, seed=cfg.run.seed + 1)
    nll = BestOfKSFT(cfg.trainer)  # its loss and microbatching; no reference model (no KL term)
    bar = tqdm(range(s.steps), desc="SFT", disable=layout.rank != 0, mininterval=2)
    for step in bar:
        rows = sft_rows(data.take(s.batch_size), tokenizer)
        mbs = nll.microbatches(rows, tokenizer.pad_token_id, cfg.trainer.micro_batch_size, layout.device,
                               seq_multiple=microbatch_seq_multiple(layout.device))
        metrics = train_step(policy, optimizer, scheduler, mbs, nll.loss)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        if step % 10 == 0 or step == s.steps - 1:
            tracker.log_metrics({"sft/loss": metrics["loss"], "sft/lr": metrics["lr"]}, step=step)
    export_hf(policy, out, tokenizer_dir=base)
    log.info("SFT done (%d steps, final loss %.3f): %s", s.steps, metrics["loss"], out)
    return out
