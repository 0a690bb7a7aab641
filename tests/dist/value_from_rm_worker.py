"""Worker for tests/test_algorithms_learner.py: PPO's value model started from a reward model.

    python tests/dist/value_from_rm_worker.py POLICY_DIR RM_DIR OUT.json

The trainer's own `build_learner` (trainer.algorithm=ppo, reward.kind=reward_model), then the value
model's values through `compute_values` (the learner's pipeline schedule) next to transformers'
`LlamaForSequenceClassification` scores of the same token ids, both in float32 (stated: `auto` would
pick bf16 on a CPU with AMX). `values[:, t]` is the value of the prefix before token t, so each
sequence gets one extra token at the end and the RM scores the rest. Then the same learner in
bf16: are the value model's fp32 main weights the RM's own values (`load_hf_main_weights`), not
their bf16 rounding?
Writes {"values": [...], "rm_scores": [...], "bf16_main_is_rm": bool, "rm_off_bf16_grid": bool}.
"""
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    policy_dir, rm_dir, out = sys.argv[1:]
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from megatron_async.config import load_config
    from megatron_async.learner.schedule import Tokens, compute_values
    from megatron_async.learner.model import unwrap_model
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run_plan import build_plan

    ppo = [f"model.hf_path={policy_dir}", "trainer.algorithm=ppo", "reward.kind=reward_model", f"reward.model_path={rm_dir}"]
    cfg = load_config(None, [*ppo, "model.dtype=float32"])
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
        cfg16 = load_config(None, [*ppo, "model.dtype=bfloat16"])
        value16 = LearnerState.build(cfg16, build_plan(cfg16), Path(policy_dir), layout, pad_id=0).value
        assert value16 is not None
        gpt = unwrap_model(value16.model.chunks[0])
        rm_tensors = {k: v for f in Path(rm_dir).glob("*.safetensors") for k, v in load_file(f).items()}
        score, embed = rm_tensors["score.weight"], rm_tensors["model.embed_tokens.weight"]
        main_is_rm = (torch.equal(gpt.output_layer.weight.main_param, score)
                      and torch.equal(gpt.embedding.word_embeddings.weight.main_param[:embed.shape[0]], embed))
        off_grid = not torch.equal(score, score.bfloat16().float()) and not torch.equal(embed, embed.bfloat16().float())
        Path(out).write_text(json.dumps({"values": values.tolist(), "rm_scores": scores.tolist(),
                                         "bf16_main_is_rm": main_is_rm, "rm_off_bf16_grid": off_grid}))
    finally:
        destroy_parallel()
