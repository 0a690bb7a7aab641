"""Worker for tests/test_checkpoint_async.py: run checkpoints written in the background
(`RunCheckpoints` with asynchronous saves, trainer.async_save) by two data-parallel ranks.

    torchrun --nproc-per-node 2 tests/dist/async_save_worker.py complete OUT HF_DIR
    torchrun --nproc-per-node 2 tests/dist/async_save_worker.py killed   OUT HF_DIR
    python                      tests/dist/async_save_worker.py load     OUT HF_DIR

complete: one Adam step, checkpoint 1 begun in the background, a second step while it is written
          (the weights change under the writer), then `wait`; -> OUT/complete.json: what `latest`
          named before and after, the bytes of shards each rank wrote (the fully parallel save
          spreads them over the DP ranks), and whether loading it gives the weights at the save
killed:   checkpoint 1 saved and completed (its weights -> OUT/saved.pt), checkpoint 2 begun, then
          every rank SIGKILLs itself while its writer runs
load:     one rank loads `latest` into a fresh learner -> OUT/loaded.json: its name and whether
          its weights are OUT/saved.pt's
"""
import argparse
import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory


def weights(learner) -> dict[str, torch.Tensor]:
    from megatron_async.learner.mapping import iter_hf_weights

    return {k: v.clone() for k, v in iter_hf_weights(learner.policy.model)}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def step(learner, seed: int) -> None:
    from megatron_async.learner.optimizer import train_step

    p = learner.policy
    train_step(p.model, p.optimizer, p.scheduler, batches(p.model.arch.vocab_size, seed=seed), nll)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["complete", "killed", "load"])
    p.add_argument("out", type=Path)
    p.add_argument("hf", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    from megatron_async.config import load_config
    from megatron_async.learner.optimizer import OptimSettings
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.run.checkpoint import RunCheckpoints, latest_checkpoint, load_run_checkpoint
    from megatron_async.run.learner_state import LearnerState, Trainable
    from tests.dist._learner import tiny_learner

    init_parallel(1, 1)
    try:
        # what a run checkpoint reads of a learner: its policy, value model and version
        policy = Trainable(*tiny_learner(a.hf, OptimSettings(lr=1e-2)))
        learner = cast(LearnerState, SimpleNamespace(value=None, policy=policy, version=1))
        cfg = load_config(None, [f"run.out_dir={a.out}"])
        ctrl = dist.new_group(backend="gloo")
        rank0 = dist.get_rank() == 0
        checkpoints = RunCheckpoints(cfg, learner, ctrl, asynchronous=True)
        if a.phase == "complete":
            step(learner, seed=0)
            at_save = weights(learner)
            path = checkpoints.save(next_step=1)
            latest_before = latest_checkpoint(cfg)
            step(learner, seed=1)
            changed = not same(weights(learner), at_save)
            checkpoints.wait()
            latest_after = latest_checkpoint(cfg)
            assert latest_after is not None
            load_run_checkpoint(cfg, learner, path)
            manifest = json.loads((path / "manifest.json").read_text())
            shard_bytes = [sum(size for name, size in manifest["sizes"].items() if name.startswith(f"dist/__{r}_"))
                           for r in range(dist.get_world_size())]
            if rank0:
                (a.out / "complete.json").write_text(json.dumps({
                    "latest_before": None if latest_before is None else latest_before.name,
                    "latest_after": latest_after.name, "second_step_changed_weights": changed,
                    "loaded_the_weights_at_the_save": same(weights(learner), at_save), "shard_bytes": shard_bytes}))
        elif a.phase == "killed":
            step(learner, seed=0)
            checkpoints.save(next_step=1)
            checkpoints.wait()
            if rank0:
                torch.save(weights(learner), a.out / "saved.pt")
            step(learner, seed=1)
            checkpoints.save(next_step=2)  # begun: its writer process is writing step_000002.tmp
            dist.barrier(group=ctrl)
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            latest = latest_checkpoint(cfg)
            assert latest is not None, a.out
            load_run_checkpoint(cfg, learner, latest)
            (a.out / "loaded.json").write_text(json.dumps({
                "latest": latest.name, "weights_as_saved": same(weights(learner), torch.load(a.out / "saved.pt"))}))
    finally:
        destroy_parallel()
