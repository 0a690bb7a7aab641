"""Held-out evaluation with greedy decoding through the vLLM replicas, scored by the run's reward.

    megatron-async eval configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf_final --output eval.json

The headline number is the mean reward of the greedy completions over the prompts that could be
scored, named by `reward.kind` (EVAL_METRIC): pass@1 for GSM8k exact match, the mean reward-model
score ("rm_score") for a reward model. Samples that could not be scored are counted ("errors",
"timeouts") and left out of the mean, never counted as 0. `greedy_eval` is what the trainer calls
before and after RL (on its own pool and scorer); `main` starts a pool on any HF checkpoint and
evaluates any jsonl/parquet file or `datasets` name, formatted as the config says (chat template
included: `data.chat_template=true`), with a progress bar over chunks of prompts.

The JSON (`--output`; eval_<tag>.json in a run dir) holds the headline numbers and, per problem:
id, question, reference answer, completion, the number read from it ("extracted", exact match),
the reward, the verdict ("correct" / "wrong" for exact match, "scored" for a reward model,
"error" / "timeout" when it could not be scored), the error and the policy version.
"""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from megatron_async.config import ConfigError
from megatron_async.data import DataError, load_prompts
from megatron_async.io_utils import atomic_write_text
from megatron_async.models.base_model import load_tokenizer
from megatron_async.rewards import extract_answer, make_scorer
from megatron_async.rollout.build import replica_spec
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.replica import Sampling
from megatron_async.run.preflight import preflight_eval

log = logging.getLogger(__name__)


EVAL_METRIC = {"gsm8k_exact_match": "pass@1", "reward_model": "rm_score"}  # reward.kind -> name


EVAL_CHUNK = 64  # prompts in flight per replica per progress-bar tick (one request each; vLLM batches them)


def _verdict(reward_kind: str, score) -> str:
    if score.timed_out:
        return "timeout"
    if score.reward is None:
        return "error"
    if reward_kind == "gsm8k_exact_match":
        return "correct" if score.reward > 0 else "wrong"
    return "scored"


def greedy_eval(pool, tokenizer, prompts, scorer, reward_kind: str, max_new_tokens: int, stop=(),
                on_error: str = "drop", progress: bool = False, desc: str = "eval") -> dict:
    """Greedy completion of every prompt, scored by `scorer` (rewards.make_scorer).

    Returns {"metric": name, name: mean reward, "n", "scored", "errors", "timeouts", "results"};
    under on_error="stop" a sample that cannot be scored raises instead. `progress`: a tqdm bar
    over chunks of EVAL_CHUNK prompts per replica.
    """
    sampling = Sampling(n=1, temperature=0.0, max_tokens=max_new_tokens, stop=tuple(stop), logprobs=False)
    step = EVAL_CHUNK * max(1, len(pool.pids()))
    records = []
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, mininterval=5) as bar:
        for start in range(0, len(prompts), step):
            chunk = prompts[start:start + step]
            records += pool.generate([p.ids for p in chunk], sampling)
            bar.update(len(chunk))
    texts = [tokenizer.decode(rec.token_ids, skip_special_tokens=True) for rec in records]
    report = scorer.score(list(prompts), texts, [p.problem.answer for p in prompts], on_error)
    exact = reward_kind == "gsm8k_exact_match"
    results = [{"id": p.problem.id, "question": p.problem.question, "reference": p.problem.answer,
                "completion": text, "extracted": extract_answer(text) if exact else None, "reward": s.reward,
                "verdict": _verdict(reward_kind, s), "error": s.error, "policy_version": rec.policy_version}
               for p, text, rec, s in zip(prompts, texts, records, report.scores)]
    kept = [s.reward for s in report.kept()]
    metric = EVAL_METRIC[reward_kind]
    return {"metric": metric, metric: sum(kept) / len(kept) if kept else float("nan"), "n": len(results),
            "scored": len(kept), "errors": report.n_errors, "timeouts": report.n_timeouts, "results": results}


def main(cfg, checkpoint: str | None = None, data: str | None = None, output: str | None = None) -> int:
    model = Path(checkpoint or cfg.model.hf_path)
    if not (model / "config.json").exists():
        print(f"megatron-async eval: {model} is not an HF checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    cfg = replace(cfg, model=replace(cfg.model, hf_path=str(model)), data=replace(cfg.data, eval=data or cfg.data.eval))
    try:
        preflight_eval(cfg)  # the checkpoint, its tokenizer and template, the file's prompts: one line if not
        tokenizer = load_tokenizer(model)
        prompts, dropped = load_prompts(cfg, tokenizer, cfg.data.eval, "test", cfg.data.eval_size)
    except (ConfigError, DataError) as e:  # DataError: a `datasets` source, read only here
        print(f"megatron-async eval: {e}", file=sys.stderr)
        return 2
    r = cfg.rollout
    scorer = make_scorer(cfg.reward)
    try:
        with ReplicaPool(replica_spec(cfg, model), r.num_replicas, host=r.host, key=r.token or None) as pool:
            result = greedy_eval(pool, tokenizer, prompts, scorer, cfg.reward.kind, r.max_new_tokens, r.stop,
                                 cfg.reward.on_error, progress=True, desc=f"eval {model.name}")
    finally:
        scorer.close()
    result.update({"model": str(model), "data": cfg.data.eval, "chat_template": cfg.data.chat_template,
                   "dropped_long_prompts": dropped})
    metric = result["metric"]
    noise = ""
    if metric == "pass@1" and result["scored"]:
        p, n = result[metric], result["scored"]
        noise = f" +- {(p * (1 - p) / n) ** 0.5:.4f} (binomial s.e.)"
    print(f"{metric} = {result[metric]:.4f}{noise} over {result['scored']}/{result['n']} scored prompts "
          f"({result['errors']} errors, {result['timeouts']} timeouts) on {cfg.data.eval}")
    if output:
        atomic_write_text(output, json.dumps(result, indent=1))
        print(f"per-problem completions and verdicts: {output}")
    return 0
