"""`megatron-async bench learner`: our learner's step against a plain PyTorch step of the same batch.

    megatron-async bench learner [--models tiny smollm2] [--algorithms online_dpo grpo] \
        [--prompts 64 16] [--k 2] [--steps 6] [--learner-cpus ""] [--profile] [--out-dir runs/bench_learner]

Per case (model x algorithm x batch size) one process builds, from the same HF checkpoint:
- ours: `LearnerState` (megatron-core GPTModel, megatron DDP and optimizer, the algorithm's
  `select` / `microbatches` / `prepare` / loss) exactly as a training run builds it, from the main
  job's config (`configs/cpu_tiny.yaml` or `configs/cpu_smollm2_gsm8k.yaml`) with the algorithm,
  K and prompts per step set;
- plain: the model loaded in transformers (`LlamaForCausalLM`, fp32, eager attention as SDPA picks
  it), a frozen copy as the reference, `torch.optim.AdamW` with the same betas, eps, weight decay
  and lr, the global-norm clip, and THE SAME microbatches and loss: the algorithm's own `prepare`
  and `loss` are called with the plain models' logprobs (`PlainModels`), so the two differ only in
  the model, the schedule around it and the optimizer. The plain step runs only the forward passes
  its loss needs (no staleness monitor); ours runs the main job's settings, monitor included.
The batch is synthetic (random prompt and completion tokens of the config's lengths, distinct
rewards within a prompt so DPO pairs and groups are never tied, generator logprobs so the
staleness monitor runs as in a training run). The two steps alternate (ours, plain, ours, ...) so
drift of a shared machine's load hits both; the first step of each is a warm-up; medians are
reported, with the ratio ours / plain and tokens per second (prompt + completion tokens of the
trained rows, once per pass). Both run in one process with the same torch thread count
(`--learner-cpus` pins it as `parallel.learner_cpus` would; default: unpinned, as the CPU main
job runs). `--profile` adds a torch.profiler table of one step of each (top ops by self CPU time)
and our step's split into phases (`LearnerState.step` timed in parts). Writes `bench_learner.json`.
Timings are never asserted in tests; only ratios within one run mean anything on a shared machine.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from megatron_async.algorithms import build_algorithm, split_units
from megatron_async.cluster.cpu_affinity import cpu_flags, pin_learner
from megatron_async.config import Config, load_config
from megatron_async.data.problem import Problem
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.parallel import init_parallel
from megatron_async.models.base_model import load_tokenizer, prepare_base_model
from megatron_async.models.smollm2 import export_smollm2
from megatron_async.rollout.producer import RolloutBatch
from megatron_async.run.learner_state import LearnerState
from megatron_async.run_plan import build_plan
from megatron_async.sample import Sample

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"tiny": REPO / "configs" / "cpu_tiny.yaml", "smollm2": REPO / "configs" / "cpu_smollm2_gsm8k.yaml"}
PROMPT_TOKENS = {"tiny": 40, "smollm2": 120}  # typical prompt lengths of the two configs' tasks


def synthetic_batch(vocab: int, prompts: int, k: int, prompt_len: int, max_new: int, seed: int) -> RolloutBatch:
    """`prompts` x `k` completions with random tokens, lengths in [max_new / 2, max_new], distinct
    rewards within each prompt (no ties), and generator logprobs, as the pool would return them."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    for p in range(prompts):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(prompt_len + rng.randrange(-prompt_len // 4, prompt_len // 4 + 1)))
        group = []
        for s in range(k):
            n = rng.randrange(max_new // 2, max_new + 1)
            group.append(Sample(prompt_index=p, prompt_token_ids=prompt, token_ids=tuple(rng.randrange(3, vocab) for _ in range(n)),
                                logprobs=tuple(-rng.uniform(0.1, 3.0) for _ in range(n)), reward=None, policy_version=0,
                                sample_index=s, replica_id=0, policy_version_max=0))
        rewards = rng.sample([i / k for i in range(k)], k)  # drawn after the group's tokens (the recorded batches)
        samples += [replace(sample, reward=r) for sample, r in zip(group, rewards, strict=True)]
    problems = [Problem(id=f"synthetic:{p}", question="", solution=None, answer=None) for p in range(prompts)]
    return RolloutBatch(index=0, policy_version=0, problems=problems, samples=samples)


def token_logprobs_hf(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] logprobs aligned as `learner.logprobs` gives them (position 0 is 0)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


@dataclass
class PlainModels:
    """`algorithms.LearnerModels` answered by transformers models (the plain reference)."""

    policy: torch.nn.Module
    reference: torch.nn.Module

    @torch.no_grad()
    def reference_logprobs(self, mbs):
        return [token_logprobs_hf(self.reference, mb["input_ids"]) * mb["loss_mask"] for mb in mbs]

    @torch.no_grad()
    def policy_logprobs(self, mbs):
        return [token_logprobs_hf(self.policy, mb["input_ids"]) * mb["loss_mask"] for mb in mbs]

    def values(self, mbs):
        raise NotImplementedError("the plain reference has no value model (PPO is not benchmarked)")


class PlainLearner:
    """The plain PyTorch step: the same selection, microbatches, preparation and loss as ours."""

    def __init__(self, cfg: Config, model_dir: Path, pad_id: int):
        t = cfg.trainer
        plain_cfg = copy.deepcopy(cfg)
        plain_cfg.trainer.staleness_monitor = False  # a plain step runs only the passes its loss needs
        self.cfg, self.algorithm, self.pad_id = cfg, build_algorithm(plain_cfg), pad_id
        policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self.models = PlainModels(policy, reference)
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                           eps=1e-8, weight_decay=t.weight_decay)

    def step(self, batch: RolloutBatch) -> float:
        t, algo, k = self.cfg.trainer, self.algorithm, batch.k
        rows, _ = algo.select(batch.scored(), k)
        minibatches = [algo.microbatches(part, self.pad_id, t.micro_batch_size, max_tokens=t.micro_batch_tokens)
                       for part in split_units(rows, algo.unit(k), t.minibatches)]
        algo.prepare(minibatches, self.models, k)
        policy, loss = self.models.policy, 0.0
        for _ in range(t.updates_per_batch):
            for mbs in minibatches:
                for mb in mbs:
                    lp = token_logprobs_hf(policy, mb["input_ids"]) * mb["loss_mask"]
                    mb_loss, _ = algo.loss(lp, mb)
                    (mb_loss / len(mbs)).backward()
                    loss += float(mb_loss.detach()) / len(mbs)
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return loss


def trained_tokens(learner: LearnerState, batch: RolloutBatch) -> int:
    rows, _ = learner.algorithm.select(batch.scored(), batch.k)
    return learner.cfg.trainer.updates_per_batch * sum(len(r.prompt_token_ids) + len(r.token_ids) for r in rows)


def profile_table(fn, rows: int = 25) -> str:

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def model_dir_for(name: str, out_dir: Path, smollm2_dir: str | None) -> tuple[Path, list[str]]:
    """The HF checkpoint of `name` and the config overrides that point at it."""
    if name == "tiny":
        cfg = load_config(CONFIGS["tiny"], [f"run.out_dir={out_dir}", "run.name=tiny_model"])
        return prepare_base_model(cfg), []
    path = Path(smollm2_dir) if smollm2_dir else out_dir / "smollm2"
    if not (path / "config.json").exists():
        export_smollm2(path)
    return path, [f"model.hf_path={path}"]


def run_case(model: str, model_dir: Path, overrides: list[str], steps: int, profile: bool, seed: int,
             micro_batch_tokens: int = 0) -> dict:
    """Ours against plain, step by step in turn; with `micro_batch_tokens`, also ours under that token
    budget ("budget": its seconds and padding against ours by rows, in the same run). Ours and plain
    go by rows (the configs' own budgets off) unless `overrides` set one."""
    cfg = load_config(CONFIGS[model], ["trainer.micro_batch_tokens=0", *overrides])
    tokenizer = load_tokenizer(model_dir)
    layout = _LAYOUT["layout"]
    ours = LearnerState.build(cfg, build_plan(cfg), model_dir, layout, tokenizer.pad_token_id)
    variants = {"ours": ours}
    if micro_batch_tokens:
        budget_cfg = load_config(CONFIGS[model], [*overrides, f"trainer.micro_batch_tokens={micro_batch_tokens}"])
        variants["budget"] = LearnerState.build(budget_cfg, build_plan(budget_cfg), model_dir, layout, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    plain = PlainLearner(cfg, model_dir, tokenizer.pad_token_id)
    vocab = len(tokenizer)
    batches = [synthetic_batch(vocab, cfg.rollout.prompts_per_step, cfg.rollout.k, PROMPT_TOKENS[model],
                               cfg.rollout.max_new_tokens, seed + i) for i in range(steps + 1)]
    tokens = trained_tokens(ours, batches[0])
    times: dict[str, list[float]] = {name: [] for name in (*variants, "plain")}
    kernel: dict[str, list[tuple[int, float]]] = {name: [] for name in times}  # (minor page faults, system CPU s) per step
    padding: dict[str, list[float]] = {name: [] for name in variants}
    for i, batch in enumerate(batches):  # alternate: ours, (budget,) plain, ours, ...; step 0 warms up
        runs = [(name, lambda learner=learner: learner.step(batch, step=i, updates=cfg.trainer.updates_per_batch))
                for name, learner in variants.items()]
        for name, step in (*runs, ("plain", lambda: plain.step(batch))):
            before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out: Any = step()  # ours: the step's metrics; plain: its loss
            seconds, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            if i:
                times[name].append(seconds)
                kernel[name].append((after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))
                if name in padding:
                    padding[name].append(out["train/padding_fraction"])
    ours_s, plain_s = statistics.median(times["ours"]), statistics.median(times["plain"])
    result: dict[str, Any] = {"model": model, "algorithm": cfg.trainer.algorithm, "prompts": cfg.rollout.prompts_per_step,
              "k": cfg.rollout.k, "micro_batch_size": cfg.trainer.micro_batch_size, "overrides": overrides,
              "trained_tokens_per_step": tokens, "ours_s": ours_s, "plain_s": plain_s,
              "ratio": ours_s / plain_s, "ours_tokens_per_s": tokens / ours_s, "plain_tokens_per_s": tokens / plain_s,
              "ours_all_s": times["ours"], "plain_all_s": times["plain"],
              "ours_padding_fraction": statistics.mean(padding["ours"]),
              # where wall time exceeds operator time: first touch of freshly mapped memory (large
              # tensors are mmap'd and returned to the OS on free, so every step faults them in again)
              **{f"{name}_{what}": statistics.median(k[j] for k in kernel[name])
                 for name in kernel for j, what in enumerate(("minor_faults", "system_s"))}}
    if "budget" in variants:
        budget_s = statistics.median(times["budget"])
        result.update({"micro_batch_tokens": micro_batch_tokens, "budget_s": budget_s, "budget_all_s": times["budget"],
                       "budget_over_ours": budget_s / ours_s, "budget_padding_fraction": statistics.mean(padding["budget"])})
    if profile:
        extra = synthetic_batch(vocab, cfg.rollout.prompts_per_step, cfg.rollout.k, PROMPT_TOKENS[model],
                                cfg.rollout.max_new_tokens, seed + 1000)
        result["profile_ours"] = profile_table(lambda: ours.step(extra, step=steps + 1,
                                                                 updates=cfg.trainer.updates_per_batch))
        result["profile_plain"] = profile_table(lambda: plain.step(extra))
    return result


_LAYOUT: dict = {}  # the one-rank process group, made once per process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-async bench learner", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=sorted(CONFIGS))
    p.add_argument("--algorithms", nargs="+", default=["online_dpo", "grpo"])
    p.add_argument("--prompts", type=int, nargs="+", default=None,
                   help="prompts per step (batch sizes); default: the config's and a quarter of it")
    p.add_argument("--k", type=int, default=None, help="completions per prompt (default: the config's)")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each (after one warm-up step)")
    p.add_argument("--learner-cpus", default="", help="pin as parallel.learner_cpus (default: unpinned)")
    p.add_argument("--smollm2-dir", default=None, help="an exported SmolLM2-135M-Instruct (default: export one)")
    p.add_argument("--profile", action="store_true", help="add torch.profiler tables of one step of each")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="also time our step under this token budget (trainer.micro_batch_tokens), in the same run")
    p.add_argument("--out-dir", default="runs/bench_learner")
    p.add_argument("overrides", nargs="*", help="section.key=value for every case")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    pinned = pin_learner(args.learner_cpus)
    _LAYOUT["layout"] = init_parallel(1, 1, seed=0)
    flags = cpu_flags()
    report: dict[str, Any] = {"command": "megatron-async bench learner " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch_threads": torch.get_num_threads(),
              "pinned_to": pinned, "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
              "load_avg_start": os.getloadavg(), "cases": []}
    for model in args.models:
        model_dir, model_overrides = model_dir_for(model, out_dir, args.smollm2_dir)
        base = load_config(CONFIGS[model], model_overrides)
        sizes = args.prompts or [base.rollout.prompts_per_step, max(1, base.rollout.prompts_per_step // 4)]
        for algorithm in args.algorithms:
            for prompts in sizes:
                overrides = [*model_overrides, f"trainer.algorithm={algorithm}", f"rollout.prompts_per_step={prompts}",
                             f"run.out_dir={out_dir}", *([f"rollout.k={args.k}"] if args.k else []), *args.overrides]
                case = run_case(model, model_dir, overrides, args.steps, args.profile, seed=0,
                                micro_batch_tokens=args.micro_batch_tokens)
                report["cases"].append(case)
                print(f"{model:8s} {algorithm:11s} {prompts:3d} prompts x K={case['k']}: ours {case['ours_s']:.3f} s "
                      f"({case['ours_tokens_per_s']:.0f} tok/s), plain {case['plain_s']:.3f} s "
                      f"({case['plain_tokens_per_s']:.0f} tok/s), ratio {case['ratio']:.2f}; page faults / system "
                      f"s per step: ours {case['ours_minor_faults']:.0f} / {case['ours_system_s']:.2f}, plain "
                      f"{case['plain_minor_faults']:.0f} / {case['plain_system_s']:.2f}; padding {case['ours_padding_fraction']:.2f}"
                      + (f"; token budget {args.micro_batch_tokens}: {case['budget_s']:.3f} s ({case['budget_over_ours']:.2f} "
                         f"of ours), padding {case['budget_padding_fraction']:.2f}" if args.micro_batch_tokens else ""),
                      flush=True)
                atomic_write_text(out_dir / "bench_learner.json", json.dumps(report, indent=1))
    report["load_avg_end"] = os.getloadavg()
    atomic_write_text(out_dir / "bench_learner.json", json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'bench_learner.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
