"""Held-out evaluation with greedy decoding through the vLLM replicas, scored by the run's reward.

    megatron-async eval configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf_final --output eval.json

The headline number is the mean reward of the greedy completions over the prompts that could be
scored, named by `reward.kind` (EVAL_METRIC): pass@1 for GSM8k exact match, the mean reward-model
score ("rm_score") for a reward model. Samples that could not be scored are counted ("errors",
"timeouts") and left out of the mean, never counted as 0. `greedy_eval` is what the trainer calls
before and after RL (on its own pool and scorer); `main` starts a pool on any HF checkpoint and
evaluates any jsonl/parquet file or `datasets` name.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from megatron_async.data import load_prompts
from megatron_async.io_utils import atomic_write_text
from megatron_async.models.base_model import load_tokenizer
from megatron_async.rewards import make_scorer
from megatron_async.rollout.build import replica_spec
from megatron_async.rollout.launcher import replica_env
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.replica import Sampling

log = logging.getLogger(__name__)


EVAL_METRIC = {"gsm8k_exact_match": "pass@1", "reward_model": "rm_score"}  # reward.kind -> name


def greedy_eval(pool, tokenizer, prompts, scorer, reward_kind: str, max_new_tokens: int, stop=(),
                on_error: str = "drop") -> dict:
    """Greedy completion of every prompt, scored by `scorer` (rewards.make_scorer).

    Returns {"metric": name, name: mean reward, "n", "scored", "errors", "timeouts", "results"};
    under on_error="stop" a sample that cannot be scored raises instead.
    """
    sampling = Sampling(n=1, temperature=0.0, max_tokens=max_new_tokens, stop=tuple(stop), logprobs=False)
    records = pool.generate([p.ids for p in prompts], sampling)
    texts = [tokenizer.decode(rec.token_ids, skip_special_tokens=True) for rec in records]
    report = scorer.score([p.text for p in prompts], texts, [p.problem.answer for p in prompts], on_error)
    results = [{"id": p.problem.id, "reference": p.problem.answer, "completion": text, "reward": s.reward,
                "error": s.error, "policy_version": rec.policy_version}
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
    tokenizer = load_tokenizer(model)
    prompts, dropped = load_prompts(cfg, tokenizer, data or cfg.data.eval, "test", cfg.data.eval_size)
    r = cfg.rollout
    scorer = make_scorer(cfg.reward)
    try:
        with ReplicaPool(replica_spec(cfg, model), r.num_replicas, host=r.host, authkey=r.token or None,
                         env=replica_env()) as pool:
            result = greedy_eval(pool, tokenizer, prompts, scorer, cfg.reward.kind, r.max_new_tokens, r.stop,
                                 cfg.reward.on_error)
    finally:
        scorer.close()
    result["dropped_long_prompts"] = dropped
    metric = result["metric"]
    print(f"{metric} = {result[metric]:.4f} over {result['scored']}/{result['n']} scored prompts "
          f"({result['errors']} errors, {result['timeouts']} timeouts) on {data or cfg.data.eval}")
    if output:
        atomic_write_text(output, json.dumps(result, indent=1))
    return 0
