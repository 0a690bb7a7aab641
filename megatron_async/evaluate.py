"""pass@1 on GSM8k-style problems with greedy decoding through the vLLM replicas.

    megatron-async eval configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf_final --output eval.json

`pass_at_1` is what the trainer calls before and after RL (on its own pool); `main` starts a
pool on any HF checkpoint and evaluates any jsonl/parquet file or `datasets` name.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def pass_at_1(pool, tokenizer, prompts, max_new_tokens: int, stop=()) -> dict:
    """Greedy completion of every prompt; exact match of its final number with the reference."""
    from megatron_async.rewards import gsm8k_reward
    from megatron_async.rollout.replica import Sampling

    sampling = Sampling(n=1, temperature=0.0, max_tokens=max_new_tokens, stop=tuple(stop), logprobs=False)
    records = pool.generate([p.ids for p in prompts], sampling)
    results = []
    for p, rec in zip(prompts, records):
        text = tokenizer.decode(rec.token_ids, skip_special_tokens=True)
        results.append({"id": p.problem.id, "reference": p.problem.answer, "completion": text,
                        "correct": gsm8k_reward(p.text, text, p.problem.answer) == 1.0,
                        "policy_version": rec.policy_version})
    n_correct = sum(r["correct"] for r in results)
    return {"pass@1": n_correct / len(results), "n": len(results), "correct": n_correct, "results": results}


def main(cfg, checkpoint: str | None = None, data: str | None = None, output: str | None = None) -> int:
    from megatron_async.io_utils import atomic_write_text
    from megatron_async.rollout.pool import ReplicaPool
    from megatron_async.trainer import load_tokenizer, replica_env, replica_spec, tokenized_problems

    model = Path(checkpoint or cfg.model.hf_path)
    if not (model / "config.json").exists():
        print(f"megatron-async eval: {model} is not an HF checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(model)
    prompts, dropped = tokenized_problems(cfg, tokenizer, data or cfg.data.eval, "test", cfg.data.eval_size)
    r = cfg.rollout
    with ReplicaPool(replica_spec(cfg, model), r.num_replicas, host=r.host, authkey=r.token or None, env=replica_env()) as pool:
        result = pass_at_1(pool, tokenizer, prompts, r.max_new_tokens, r.stop)
    result["dropped_long_prompts"] = dropped
    print(f"pass@1 = {result['pass@1']:.4f} ({result['correct']}/{result['n']}) on {data or cfg.data.eval}")
    if output:
        atomic_write_text(output, json.dumps(result, indent=1))
    return 0
