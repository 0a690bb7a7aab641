"""Worker for tests/test_algorithms_learner.py: PPO's value model started from a reward model.

    python tests/dist/value_from_rm_worker.py POLICY_DIR RM_DIR OUT.json

The trainer's own `build_learner` (trainer.algorithm=ppo, reward.kind=reward_model), then the value
model's values through `compute_values` (the learner's pipeline schedule) next to transformers'
`LlamaForSequenceClassification` scores of the same token ids, both in float32 (stated: `auto` would
pick bf16 on a CPU with AMX). `values[:, t]` is the value of the prefix before token t, so each
sequence gets one extra token at the end and the RM scores the rest.
Writes {"values": [...], "rm_scores": [...]}.
"""
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    policy_dir, rm_dir, out = sys.argv[1:]
    torch.set_num_threads(1)
    from transformers import AutoModelForSequenceClassification

    from megatron_async.config import load_config
    from megatron_async.learner.schedule import Tokens, compute_values
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run_plan import build_plan

    cfg = load_config(None, [f"model.hf_path={policy_dir}", "model.dtype=float32", "trainer.algorithm=ppo", "reward.kind=reward_model",
                             f"reward.model_path={rm_dir}"])
    layout = init_parallel(1, 1, seed=0)
    try:
        learner = LearnerState.build(cfg, build_plan(cfg), Path(policy_dir), layout, pad_id=0)
        rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, use_safetensors=True, dtype=torch.float32).eval()
        # no pad token (id 0) among them: the RM scores the last token of each row
        ids = torch.randint(3, rm.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
        assert learner.value is not None  # PPO's
        values = compute_values(learner.value.model, [Tokens(input_ids=torch.cat([ids, ids[:, :1]], dim=1))])[0][:, -1]
        with torch.no_grad():
            scores = rm(input_ids=ids).logits[:, 0]
        Path(out).write_text(json.dumps({"values": values.tolist(), "rm_scores": scores.tolist()}))
    finally:
        destroy_parallel()
