"""Entry point of `megatron-async train`: check, launch the learner ranks, build, run, close.

    megatron-async train configs/cpu_tiny.yaml                  # one learner rank on this machine
    megatron-async train configs/cpu_tiny.yaml parallel.tp=2    # relaunches itself: torchrun, 2 ranks
    torchrun --nproc-per-node 8 -m megatron_async train cfg.yaml parallel.tp=8   # what launch/ does

The preflight (`run/preflight.py`: files, model, data, checkpoint, CPUs, GPUs) runs once, before
anything starts: in this process, and not again in the ranks it relaunches. Then the process that
starts learner rank 0 takes the run folder for the run's lifetime (`run/run_lock.py`). Without
torchrun variables and with more than one learner rank needed (tp x pp, or --nproc), the command
relaunches itself under `python -m torch.distributed.run` on 127.0.0.1. The vLLM replicas are
started by learner rank 0 (`run/rollout_state.py`), never by torchrun.

Stopping (`run/stop.py`): every rank listens for SIGTERM / SIGUSR1 (checkpoint at the step
boundary, exit 75 = requeue me) and Ctrl-C (stop now); either way one line says what was saved and
how to continue. A relaunching launcher forwards the signals it receives to the ranks and reports
their stop as its own exit status. At start, /dev/shm segments of runs that died are removed.
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys

import psutil
import torch

from megatron_async.cluster.cpu_affinity import pin_learner
from megatron_async.cluster.placement import check_runtime, nproc_per_node
from megatron_async.config import Config, ConfigError, stop_budget
from megatron_async.learner.parallel import destroy_parallel, free_port
from megatron_async.observability.logs import attach_log_file
from megatron_async.run.preflight import preflight
from megatron_async.run.checkpoint import CheckpointSaveError, latest_checkpoint
from megatron_async.run.run_lock import RunLock
from megatron_async.run.stop import EXIT_INTERRUPTED, EXIT_REQUEUE, STOP_SIGNALS, Stopped, StopSignals, stop_at_once
from megatron_async.run.trainer import Trainer
from megatron_async.run_plan import build_plan
from megatron_async.weights.host_memory import sweep_dead_segments, unlink_live_segments

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
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               *torchrun_stop_flags(cfg), "-m", "megatron_async", "train", config_path, *overrides]
        if cfg.run.resume:
            cmd.append("--resume")
        return run_forwarding_signals(cmd, env={**os.environ, CHECKED_ENV: "1"})

    log_path = attach_log_file(cfg.run_dir / "train.log")  # library warnings, megatron's config dumps: file only
    logging.getLogger(__name__).info("run %s in %s (full log: %s); building the learner and replicas...",
                                     cfg.run.name, cfg.run_dir, log_path)
    plan = build_plan(cfg)  # every `auto` and machine fact, once (run_plan.py); Trainer.build shares rank 0's
    logging.getLogger(__name__).info("%s", plan.describe())
    pin_learner(plan.learner_cpus)  # before any torch thread pool exists; replicas re-pin
    files, freed = sweep_dead_segments()
    if files:
        logging.getLogger(__name__).info("removed %d weight-sync segment(s) of runs that died (%.0f MiB of /dev/shm)",
                                         files, freed / 2**20)
    def at_once(why: str) -> None:  # os._exit follows: no finally of this process runs
        if lock is not None:
            lock.release()
        stop_at_once(why, unlink_live_segments)

    stop = StopSignals(cfg.run.stop_deadline_s, at_once=at_once).install()
    trainer = None
    try:
        try:
            trainer = Trainer.build(cfg, plan, stop)
            stopped = trainer.train()
        finally:
            if trainer is not None:
                trainer.close()
            destroy_parallel()
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", 0)) == 0:
            last = latest_checkpoint(cfg)
            saved = f"the last checkpoint is {last}" if last else "no checkpoint was saved yet"
            print(f"megatron-async: interrupted (Ctrl-C); {saved}; continue with: {resume_command(config_path, overrides)}",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    except CheckpointSaveError as e:  # raised on every rank (a full disk, a read-only folder); rank 0 says it
        if int(os.environ.get("RANK", 0)) == 0:
            then = f"; once that is fixed, continue with: {resume_command(config_path, overrides)}"
            print(f"megatron-async: {e}{then if latest_checkpoint(cfg) else ''}", file=sys.stderr)
        return 1
    finally:
        stop.uninstall()
    if stopped is None:
        return 0
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"megatron-async: stopped by {stopped.signal} at step {stopped.next_step} of {cfg.trainer.steps}; "
              f"checkpoint {stopped.checkpoint}; continue with: {resume_command(config_path, overrides)}", file=sys.stderr)
    # under this command's own relaunch the launcher reports the stop (torchrun would call 75 a failure)
    return 0 if os.environ.get(CHECKED_ENV) == "1" else EXIT_REQUEUE


def resume_command(config_path: str, overrides: list[str]) -> str:
    """The command that continues this run: from `latest`, which a run.resume_from run has moved to
    its own checkpoints, so that override is left out (repeated, it would go back again)."""
    kept = [o for o in overrides if not o.startswith("run.resume_from=")]
    return shlex.join(["megatron-async", "train", config_path, *kept, "--resume"])


def torchrun_stop_flags(cfg: Config) -> list[str]:
    """torchrun forwards SIGUSR1 too (its default list lacks it), and waits for the ranks' stop
    (config.stop_budget) before it kills them. launch/*.sh pass the same two flags."""
    return ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            f"--shutdown-timeout={stop_budget(cfg.run).shutdown_timeout_s}"]


def run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun; SIGTERM, SIGUSR1 and SIGINT sent to this launcher go to the ranks (torchrun's
    children; torchrun itself until it has started them). Exit: the ranks' status, or EXIT_REQUEUE
    when a stop signal was forwarded and the ranks stopped cleanly.

    torchrun runs in a process group of its own (its ranks in sessions of their own, torchrun's
    doing), so a signal to this launcher's group (`timeout`, `kill -TERM -PGID`, Ctrl-C) reaches
    the ranks once, through here: torchrun itself, signalled, would stop its agent with an error
    (exit 1, SignalException) while the ranks still save."""
    proc = subprocess.Popen(cmd, env=env, process_group=0)
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        ranks = psutil.Process(proc.pid).children()
        for target in ranks or [proc]:
            target.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0 and any(sig in STOP_SIGNALS for sig in forwarded):
        return EXIT_REQUEUE
    return code
