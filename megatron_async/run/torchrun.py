"""The torchrun command line that starts learner ranks, written once for every launcher.

    [sys.executable, *torchrun_args(cfg, [config, *overrides], nproc_per_node=2)]    # run/launch.py's relaunch
    megatron-async torchrun-args CFG [overrides] --nproc-per-node 8 [--nnodes 2 --node-rank 1 \\
        --master-addr node0 --master-port 29500]     # launch/*.sh: prints TORCHRUN_ARGS=(...) to eval

torchrun forwards SIGUSR1 too (its default list lacks it; SLURM's warning, run/stop.py) and waits
for the ranks' stop before it kills them: `stop_budget` derives that wait and the SLURM scripts'
warning from run.stop_deadline_s (`megatron-async stop-plan` prints it). The rendezvous is static
(--node-rank, --master-addr/--master-port; launch/multi_node.sh says why not c10d); one node's
is on 127.0.0.1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_async.config import Config, RunConfig
from megatron_async.learner.parallel import free_port

TORCHRUN_GRACE_S = 60  # torchrun's wait beyond run.stop_deadline_s: the ranks' exit after their save or stop at once


@dataclass(frozen=True)
class StopBudget:
    """run.stop_deadline_s and what the launchers derive from it, in whole seconds (`stop_budget`)."""
    deadline_s: int  # signal -> checkpoint saved and exit 75, or stop at once (run/stop.py)
    shutdown_timeout_s: int  # torchrun's --shutdown-timeout: how long it waits for its ranks before SIGKILL
    warning_lead_s: int  # the SLURM scripts' USR1 this long before the time limit: the whole stop fits before it


def stop_budget(run: RunConfig) -> StopBudget:
    """The one place the stop's time budget is derived: torchrun waits the ranks' deadline plus
    TORCHRUN_GRACE_S, and the SLURM warning comes that long before the time limit, so that SLURM's
    own SIGTERM (and SIGKILL after KillWait) finds the job already saved and stopped."""
    deadline = math.ceil(run.stop_deadline_s)
    shutdown = deadline + TORCHRUN_GRACE_S
    return StopBudget(deadline_s=deadline, shutdown_timeout_s=shutdown, warning_lead_s=shutdown)


def torchrun_stop_flags(cfg: Config) -> list[str]:
    """torchrun forwards SIGUSR1 too, and waits run.stop_deadline_s + TORCHRUN_GRACE_S for its ranks."""
    return ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            f"--shutdown-timeout={stop_budget(cfg.run).shutdown_timeout_s}"]


def torchrun_args(cfg: Config, train_args: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", master_port: int | None = None) -> list[str]:
    """Python's arguments that run `megatron-async train *train_args` as this node's learner ranks
    under torchrun (`master_port` None: a port of this machine that is free now)."""
    return ["-m", "torch.distributed.run", *torchrun_stop_flags(cfg), f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc_per_node}", f"--master-addr={master_addr}",
            f"--master-port={master_port or free_port()}", "-m", "megatron_async", "train", *train_args]
