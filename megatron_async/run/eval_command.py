"""`megatron-async eval`: greedy held-out evaluation of any HF checkpoint on a replica pool of its own.

    megatron-async eval configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf_final --output eval.json

Evaluates any jsonl/parquet file or `datasets` name, formatted as the config says (chat template
included: `data.chat_template=true`), with `run.evaluate.greedy_eval`, after the preflight's checks
of the checkpoint and the data (`preflight_eval`). Its own module, apart from run/evaluate.py
(which the run's RolloutState uses), so the preflight is not imported by the training loop.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from megatron_async.config import ConfigError
from megatron_async.data import DataError, load_prompts
from megatron_async.io_utils import atomic_write_text
from megatron_async.models.base_model import load_tokenizer
from megatron_async.rewards import make_scorer
from megatron_async.rollout.build import replica_spec
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.run.evaluate import greedy_eval
from megatron_async.run.preflight import preflight_eval
from megatron_async.run_plan import build_plan


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
        with ReplicaPool(replica_spec(cfg, build_plan(cfg), model), r.num_replicas, host=r.host, key=r.token or None) as pool:
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
