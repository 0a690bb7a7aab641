"""Entry point of `megatron-async train`: check, launch the learner ranks, build, run, close.

    megatron-async train configs/cpu_tiny.yaml                  # one learner rank on this machine
    megatron-async train configs/cpu_tiny.yaml parallel.tp=2    # relaunches itself: torchrun, 2 ranks
    torchrun --nproc-per-node 8 -m megatron_async train cfg.yaml parallel.tp=8   # what launch/ does

The preflight (`run/preflight.py`: files, model, data, checkpoint, CPUs, GPUs) runs once, before
anything starts: in this process, and not again in the ranks it relaunches. Without torchrun
variables and with more than one learner rank needed (tp x pp, or --nproc), the command
relaunches itself under `python -m torch.distributed.run` on 127.0.0.1. The vLLM replicas are
started by learner rank 0 (`run/rollout_state.py`), never by torchrun.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

from megatron_async.cluster.cpu_affinity import pin_learner
from megatron_async.cluster.placement import check_runtime, cpu_plan, nproc_per_node
from megatron_async.config import Config, ConfigError
from megatron_async.learner.parallel import destroy_parallel, free_port
from megatron_async.observability.logs import attach_log_file
from megatron_async.run.preflight import preflight
from megatron_async.run.trainer import Trainer

CHECKED_ENV = "MEGATRON_ASYNC_PREFLIGHT_DONE"  # set for the ranks this launcher relaunches


def main(cfg: Config, config_path: str, overrides: list[str], nproc: int | None = None) -> int:
    ranks = nproc or cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
    under_torchrun = "LOCAL_RANK" in os.environ
    if nproc is None and cfg.placement.nnodes == 1 and not under_torchrun and torch.cuda.is_available():
        ranks = nproc_per_node(cfg, 0, torch.cuda.device_count())  # one GPU node: a rank per learner GPU
    relaunch = ranks > 1 and not under_torchrun
    try:
        if os.environ.get(CHECKED_ENV) != "1":
            preflight(cfg, world_size=int(os.environ.get("WORLD_SIZE", ranks)))
        if not relaunch:  # this process is a learner rank: torchrun's node and rank counts against placement.*
            check_runtime(cfg)
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    if relaunch:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               "-m", "megatron_async", "train", config_path, *overrides]
        if cfg.run.resume:
            cmd.append("--resume")
        return subprocess.call(cmd, env={**os.environ, CHECKED_ENV: "1"})

    log_path = attach_log_file(cfg.run_dir / "train.log")  # library warnings, megatron's config dumps: file only
    logging.getLogger(__name__).info("run %s in %s (full log: %s); building the learner and replicas...",
                                     cfg.run.name, cfg.run_dir, log_path)
    cpus = cpu_plan(cfg)  # "auto" CPU keys resolved once: the saved config and the replica pool see the lists used
    cfg.parallel.learner_cpus, cfg.rollout.replica_cpus = cpus.learner, cpus.replica
    logging.getLogger(__name__).info("%s", cpus.describe())
    pin_learner(cpus.learner)  # before any torch thread pool exists; replicas re-pin
    trainer = None
    try:
        trainer = Trainer.build(cfg)
        trainer.train()
        return 0
    finally:
        if trainer is not None:
            trainer.close()
        destroy_parallel()
