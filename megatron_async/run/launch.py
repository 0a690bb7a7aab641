"""Entry point of `megatron-async train`: check, launch the learner ranks, build, run, close.

    megatron-async train configs/cpu_tiny.yaml                  # one learner rank on this machine
    megatron-async train configs/cpu_tiny.yaml parallel.tp=2    # relaunches itself: torchrun, 2 ranks
    torchrun --nproc-per-node 8 -m megatron_async train cfg.yaml parallel.tp=8   # what launch/ does

The preflight (`run/preflight.py`: files, model, data, checkpoint, CPUs, GPUs) runs once, before
anything starts: in this process, not again in the ranks it relaunches. Then the process that starts
learner rank 0 takes the run folder for the run's lifetime (`run/run_lock.py`). Without torchrun
variables and with more than one learner rank needed (tp x pp, or --nproc), the command relaunches
itself under torchrun (`run/torchrun.py`). Learner rank 0 starts the vLLM replicas, never torchrun.

Stopping (`run/stop.py`): SIGTERM / SIGUSR1 save at the step boundary, exit 75 (requeue me); Ctrl-C
stops now; one line says what was saved and how to continue. At start, dead runs' /dev/shm is freed.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import closing

import torch

from megatron_async.cluster.cpu_affinity import pin_learner
from megatron_async.cluster.placement import check_runtime, nproc_per_node
from megatron_async.config import Config, ConfigError
from megatron_async.learner.parallel import destroy_parallel
from megatron_async.observability.logs import attach_log_file
from megatron_async.run.preflight import preflight
from megatron_async.run.checkpoint import CheckpointSaveError, latest_checkpoint
from megatron_async.run.run_lock import RunLock
from megatron_async.run.stop import Stopped, StopSignals, exit_status, resume_command, run_forwarding_signals, stop_at_once
from megatron_async.run.torchrun import torchrun_args
from megatron_async.run.trainer import Trainer
from megatron_async.run_plan import build_plan
from megatron_async.weights.host_memory import sweep_dead_segments, unlink_live_segments

CHECKED_ENV = "MEGATRON_ASYNC_PREFLIGHT_DONE"  # set for the ranks this launcher relaunches
log = logging.getLogger(__name__)


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
        # one process per run holds its folder (run/run_lock.py): the one that starts learner rank 0
        owns_folder = os.environ.get(CHECKED_ENV) != "1" and os.environ.get("RANK", "0") == "0"
        lock = RunLock.take(cfg) if owns_folder else None
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    try:
        return _launch(cfg, config_path, overrides, ranks, relaunch, lock)
    finally:
        if lock is not None:
            lock.release()


def _launch(cfg: Config, config_path: str, overrides: list[str], ranks: int, relaunch: bool,
            lock: RunLock | None) -> int:
    """Relaunch under torchrun, or build and train this learner rank; -> the exit status."""
    if relaunch:
        train_args = [config_path, *overrides, *(["--resume"] if cfg.run.resume else [])]
        cmd = [sys.executable, *torchrun_args(cfg, train_args, nproc_per_node=ranks)]
        assert lock is not None  # the relaunching command is the one that starts rank 0
        return run_forwarding_signals(cmd, env={**os.environ, CHECKED_ENV: "1"}, started=lock.name_torchrun)

    log_path = attach_log_file(cfg.run_dir / "train.log")  # library warnings, megatron's config dumps: file only
    log.info("run %s in %s (full log: %s); building the learner and replicas...", cfg.run.name, cfg.run_dir, log_path)
    plan = build_plan(cfg)  # every `auto` and machine fact, once (run_plan.py); Trainer.build shares rank 0's
    log.info("%s", plan.describe())
    pin_learner(plan.learner_cpus)  # before any torch thread pool exists; replicas re-pin
    files, freed = sweep_dead_segments()
    if files:
        log.info("removed %d weight-sync segment(s) of runs that died (%.0f MiB of /dev/shm)", files, freed / 2**20)
    def at_once(why: str) -> None:  # os._exit follows: no finally of this process runs
        if lock is not None:
            lock.release()
        stop_at_once(why, unlink_live_segments)

    stop = StopSignals(cfg.run.stop_deadline_s, at_once=at_once).install()
    try:
        try:
            with closing(Trainer.build(cfg, plan, stop)) as trainer:
                ended: Stopped | KeyboardInterrupt | CheckpointSaveError | None = trainer.train()
        finally:
            destroy_parallel()
    except (KeyboardInterrupt, CheckpointSaveError) as e:  # a save error is raised on every rank
        ended = e
    finally:
        stop.uninstall()
    last = latest_checkpoint(cfg) if ended is not None else None
    return exit_status(ended, cfg, resume_command(config_path, overrides), os.environ.get(CHECKED_ENV) == "1", last)
