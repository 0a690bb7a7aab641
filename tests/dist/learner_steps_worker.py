"""A few learner steps of the main job's model on fixed synthetic batches; prints their metrics as JSON.

    python tests/dist/learner_steps_worker.py ALGORITHM RUN_DIR [OVERRIDE ...]

One rank (gloo), the main job's config (`configs/cpu_tiny.yaml`, seed 1234) with
`trainer.algorithm=ALGORITHM`, 16 prompts x K=4 per step (`bench.learner.synthetic_batch`, seeds
0, 1, 2). The model has the main job's shape, but its tokenizer is trained on the fixed
`models/tiny.default_corpus`, not on the main job's SFT data: the vocabulary (and so the
embedding's size and the batches' token ids) must not move when the data recipe does.
test_learner_regression.py compares the losses with values recorded before a change to the
learner's step (behaviour unchanged to float tolerance). OVERRIDEs (`key=value`) change
settings that must not change the numbers, e.g. `trainer.logits_chunk_mb`.
"""
import json
import sys
from pathlib import Path

import torch

from megatron_async.bench.learner import PROMPT_TOKENS, synthetic_batch
from megatron_async.config import load_config
from megatron_async.learner.parallel import init_parallel
from megatron_async.models.base_model import load_tokenizer, tiny_spec
from megatron_async.models.tiny import build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.run.learner_state import LearnerState
from megatron_async.run_plan import build_plan

KEYS = ("train/loss", "train/grad_norm", "kl/ref", "staleness/kl_k3_mean", "staleness/iw_max")

if __name__ == "__main__":
    algorithm, run_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml",
                      [f"run.out_dir={run_dir}", f"trainer.algorithm={algorithm}", "rollout.prompts_per_step=16",
                       "rollout.k=4", "trainer.micro_batch_size=8", "trainer.steps=3",
                       "trainer.micro_batch_tokens=0",  # recorded by rows; the budget test overrides it
                       *sys.argv[3:]])
    layout = init_parallel(1, 1, seed=cfg.run.seed)
    model_dir = run_dir / "base_model"
    build_tiny_llama(model_dir, build_tokenizer(default_corpus(), model_dir, vocab_size=1024), tiny_spec(cfg.model),
                     seed=cfg.run.seed)
    tokenizer = load_tokenizer(model_dir)
    learner = LearnerState.build(cfg, build_plan(cfg), model_dir, layout, tokenizer.pad_token_id)
    steps = []
    for step in range(3):
        batch = synthetic_batch(len(tokenizer), 16, 4, PROMPT_TOKENS["tiny"], cfg.rollout.max_new_tokens, seed=step)
        metrics = learner.step(batch, step, updates=1)
        steps.append({k: metrics[k] for k in KEYS if k in metrics})
    print("STEPS " + json.dumps(steps))
