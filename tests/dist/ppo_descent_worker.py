"""Worker for tests/test_algorithms_learner.py: PPO learner steps on one fixed batch.

    python tests/dist/ppo_descent_worker.py MODEL_DIR OUT.json
    python -m torch.distributed.run --nproc-per-node 2 tests/dist/ppo_descent_worker.py MODEL_DIR OUT.json --pp 2

The trainer's own learner (`run.learner_state.LearnerState`: megatron-core policy, reference and
value model, the PPO algorithm object) and its own `LearnerState.step`, called 6 times on the same batch: 4 prompts x K=2
completions, one scored 1 and one 0, with the initial policy's logprobs as the generator's (as
vLLM reports them at version 0). Then a run checkpoint is saved, loaded into a freshly built
learner, and both take one more step (two passes, so Adam state and LR schedule count). Rank 0
writes every step's metrics, each completion's summed logprob under the policy before and after
the 6 steps, the metrics of the continued and the resumed 7th step, and the three models' parameter
dtypes (`model.dtype` decides them: float32 unless an override says otherwise, never `auto`, whose
pick depends on the CPU). The batch stays the one version 0 generated, so from the second
step on it is off-policy data for the learner.
"""
import argparse
import json
from dataclasses import replace
from pathlib import Path
import torch

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="more config overrides, e.g. trainer.off_policy_correction=none")
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.algorithms.losses import sequence_logprobs
    from megatron_async.config import load_config
    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.rollout.producer import RolloutBatch
    from megatron_async.run.checkpoint import load_run_checkpoint, save_run_checkpoint
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run_plan import build_plan
    from megatron_async.sample import Sample
    from tests.batches import problems

    # gamma = lam = 1: the returns are the rewards-to-go, fixed targets for the value model
    cfg = load_config(None, [f"run.out_dir={Path(a.out).parent}", f"run.name=tp{a.tp}pp{a.pp}",
                             f"model.hf_path={a.model_dir}", "model.dtype=float32", f"parallel.tp={a.tp}", f"parallel.pp={a.pp}",
                             "trainer.algorithm=ppo", "rollout.k=2", "trainer.lr=1e-3", "trainer.value_lr=3e-3",
                             "trainer.warmup_steps=0", "trainer.lr_decay=constant", "trainer.gamma=1.0",
                             "trainer.lam=1.0", "trainer.updates_per_batch=2", "trainer.micro_batch_size=3",
                             *a.overrides])
    layout = init_parallel(a.tp, a.pp, seed=0)
    try:
        g = torch.Generator().manual_seed(0)
        samples = []
        for prompt in range(4):
            ids = torch.randint(3, 300, (5,), generator=g).tolist()
            for reward in (1.0, 0.0):
                n = int(torch.randint(3, 8, (1,), generator=g))
                samples.append(Sample(prompt_index=prompt, prompt_token_ids=ids, logprobs=None, reward=reward, policy_version=0,
                                      token_ids=torch.randint(3, 300, (n,), generator=g).tolist()))

        def new_learner():
            return LearnerState.build(cfg, build_plan(cfg), a.model_dir, layout, pad_id=0)

        learner = new_learner()
        mbs = learner.algorithm.microbatches(samples, pad_id=0, micro_batch_size=len(samples))
        gen = compute_logprobs(learner.reference, mbs)[0]  # [rows, s], 0 off the completion tokens
        generated = [replace(s, logprobs=tuple(gen[i, len(s.prompt_token_ids):len(s.prompt_token_ids) + len(s.token_ids)].tolist()))
                     for i, s in enumerate(samples)]  # as the pool returns them: with the generator's logprobs
        batch = RolloutBatch(index=0, policy_version=0, problems=problems(4), samples=generated)
        updates = cfg.trainer.updates_per_batch
        history = [learner.step(batch, 0, updates) for _ in range(6)]
        after = compute_logprobs(learner.policy.model, mbs)[0]
        ctrl = torch.distributed.new_group(backend="gloo")
        path = save_run_checkpoint(cfg, learner, ctrl, next_step=6)  # the learner's state only: no rollout side here
        resumed = new_learner()
        assert load_run_checkpoint(cfg, resumed, path) == 6
        continued_step, resumed_step = learner.step(batch, 6, updates), resumed.step(batch, 6, updates)
        if torch.distributed.get_rank() == 0:
            mask = mbs[0]["loss_mask"]
            with open(a.out, "w") as f:
                json.dump({"history": history, "rewards": mbs[0]["rewards"].tolist(),
                           "logp_before": sequence_logprobs(gen, mask).tolist(),
                           "logp_after": sequence_logprobs(after, mask).tolist(),
                           "continued_step": continued_step, "resumed_step": resumed_step,
                           "dtypes": {name: str(next(m.chunks[0].parameters()).dtype) for name, m in
                                      (("policy", learner.policy.model), ("reference", learner.reference),
                                       ("value", learner.value.model))}}, f)
    finally:
        destroy_parallel()
