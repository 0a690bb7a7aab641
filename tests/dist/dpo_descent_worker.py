"""Worker for tests/test_algorithms_learner.py: Online DPO steps on one fixed batch of pairs.

    python tests/dist/dpo_descent_worker.py MODEL_DIR OUT.json

Real megatron-core learner and reference, the trainer's own batch building and loss
(`algorithms`), 6 optimizer steps on the same 8 (chosen, rejected) pairs; writes the metrics of
every step. If the update had the wrong sign the DPO loss on that batch would rise.
"""
import json
import sys

import torch

if __name__ == "__main__":
    from megatron_async.algorithms.base import attach
    from megatron_async.algorithms.online_dpo import OnlineDPO
    from megatron_async.config import TrainerConfig
    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from megatron_async.learner.parallel import init_parallel
    from megatron_async.sample import Sample
    from tests.dist._learner import loaded_model, tiny_learner

    model_dir, out = sys.argv[1], sys.argv[2]
    init_parallel(1, 1, seed=0)
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(8):
        prompt = torch.randint(3, 300, (5,), generator=g).tolist()
        for reward in (1.0, 0.0):
            completion = torch.randint(3, 300, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
            samples.append(Sample(prompt_index=p, prompt_token_ids=prompt, token_ids=completion, logprobs=None,
                                  reward=reward, policy_version=0))
    dpo = OnlineDPO(TrainerConfig(beta=0.1))
    rows, _ = dpo.select(samples, 2)
    mbs = dpo.microbatches(rows, pad_id=0, micro_batch_size=6)
    attach(mbs, "ref_logprobs", compute_logprobs(loaded_model(model_dir), mbs))
    ddp, opt, sched = tiny_learner(model_dir, OptimSettings(lr=1e-3, clip_grad=1.0))
    history = [train_step(ddp, opt, sched, mbs, dpo.loss) for _ in range(6)]
    with open(out, "w") as f:
        json.dump(history, f)
