"""Entry point of `megatron-async train`: launch the learner ranks, build, run, close.

    megatron-async train configs/cpu_tiny.yaml                  # one learner rank on this machine
    megatron-async train configs/cpu_tiny.yaml parallel.tp=2    # relaunches itself: torchrun, 2 ranks
    torchrun --nproc-per-node 8 -m megatron_async train cfg.yaml parallel.tp=8   # what launch/ does

Without torchrun variables and with more than one learner rank needed (tp x pp, or --nproc), the
command relaunches itself under `python -m torch.distributed.run` on 127.0.0.1. The vLLM
replicas are started by learner rank 0 (see `trainer.py`), never by torchrun.
"""
from __future__ import annotations

import os
import subprocess
import sys


def main(cfg, config_path: str, overrides: list[str], nproc: int | None = None) -> int:
    ranks = nproc or cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
    if nproc is None and cfg.placement.nnodes == 1 and "LOCAL_RANK" not in os.environ:
        import torch

        if torch.cuda.is_available():  # one GPU node: a learner rank per learner GPU (placement.*)
            from megatron_async.cluster.placement import nproc_per_node

            ranks = nproc_per_node(cfg, 0, torch.cuda.device_count())
    if ranks > 1 and "LOCAL_RANK" not in os.environ:
        from megatron_async.learner.parallel import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               "-m", "megatron_async", "train", config_path, *overrides]
        if cfg.run.resume:
            cmd.append("--resume")
        return subprocess.call(cmd)

    from megatron_async.config import ConfigError, validate
    from megatron_async.learner.parallel import destroy_parallel
    from megatron_async.cluster.placement import check_runtime as check_placement
    from megatron_async.run.trainer import Trainer

    try:
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        check_placement(cfg)  # torchrun's node and rank counts against placement.*
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    from megatron_async.cluster.cpu_affinity import pin_learner

    pin_learner(cfg.parallel.learner_cpus)  # before any torch thread pool exists; replicas re-pin
    trainer = None
    try:
        trainer = Trainer.build(cfg)
        trainer.train()
        return 0
    finally:
        if trainer is not None:
            trainer.close()
        destroy_parallel()
