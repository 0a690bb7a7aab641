"""Replica servers on this machine: `LocalLauncher` starts, reports on and kills them.

Each replica's `vllm serve` runs under a small supervisor (`rollout/supervisor.py`) in a session
of its own, so the API server, vLLM's engine-core process and its workers form one process group:
- `kill` signals the whole group: no engine process outlives its replica (a leftover engine on a
  GPU holds its weights and KV cache and blocks the restart);
- the supervisor watches the process that launched it and kills the group when that process is
  gone (a SIGKILLed learner leaves no server behind; vLLM has no parent-death handling of its own);
- with rollout.replica_cpus the supervisor pins itself before it starts the server, so every
  process of the group inherits those CPUs (pinning in a `preexec_fn` would run Python between fork
  and exec in this threaded process).

The environment of a replica is the launcher's (`replica_environment`) without what is meant for
the learner only: torchrun's rendezvous variables (vLLM sets up its own torch.distributed world)
and `CUDA_DEVICE_MAX_CONNECTIONS` (launch/gpu_env.sh sets 1 for Megatron's TP overlap; it would
leave vLLM's streams one hardware queue). Every NCCL_* variable stays, the transport's tuning
(NCCL_ALGO, NCCL_PROTO, channels, buffer sizes) as well as its network selection: the learner's
senders and a replica's workers form one NCCL communicator for weight sync (rollout.
weight_transport: nccl), and peers of one communicator must set the same NCCL_* variables or it
hangs (vLLM says so where it pins its own, vllm/utils/nccl.py). A replica that needs a dropped
variable gets it through the pool's `env` (or ReplicaSpec.env).

The pool (`pool.py`) supervises: failure budget, restarts, requeues, "stale until re-synced". A
launcher only starts, reports, kills and shows logs. Servers started elsewhere (another node, a
SLURM `srun` line) are given to the pool as `rollout.replica_urls` and need no launcher.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from megatron_async.cluster.cpu_affinity import REPLICA_CPUS_ENV, format_cpu_list, parse_cpu_list
from megatron_async.rollout.replica import ReplicaClient, ReplicaSpec, server_command, server_env
from megatron_async.rollout.supervisor import signal_group

SUPERVISOR = Path(__file__).with_name("supervisor.py")

TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}
LEARNER_ONLY_VARS = {"CUDA_DEVICE_MAX_CONNECTIONS"}


def replica_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a replica's server inherits of `environ` (this process's environment): all but the
    learner's own variables (torchrun's rendezvous, CUDA_DEVICE_MAX_CONNECTIONS); NCCL_* stays."""
    def learner_only(key: str) -> bool:
        return key in TORCHRUN_VARS or key.startswith("TORCHELASTIC_") or key in LEARNER_ONLY_VARS
    return {k: v for k, v in environ.items() if not learner_only(k)}


class PoolError(RuntimeError):
    """The pool cannot go on: a replica failed too often, could not start, or no work finished in time."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalLauncher:
    """Replica servers as this process's children; output in `log_dir/replica<i>.log`."""

    def __init__(self, spec: ReplicaSpec, host: str, key: str, log_dir: Path, start_timeout_s: float,
                 gpu: bool, env: dict[str, str] | None = None, devices: Sequence[str] | None = None):
        self.spec, self.host, self.key, self.log_dir = spec, host, key, Path(log_dir)
        self.start_timeout_s, self.gpu = start_timeout_s, gpu
        self.env, self.devices = dict(env or {}), devices
        self._procs: dict[int, subprocess.Popen] = {}

    def log_path(self, rid: int) -> Path:
        return self.log_dir / f"replica{rid}.log"

    def start(self, rid: int, port: int) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self.environment(rid)
        with open(self.log_path(rid), "ab") as log:
            self._procs[rid] = subprocess.Popen(self.command(env, port), stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def environment(self, rid: int) -> dict[str, str]:
        """Replica `rid`'s environment: this process's (`replica_environment`), the pool's `env`,
        the server's own (key, dev mode), its GPUs."""
        env = {**replica_environment(os.environ), **self.env, **server_env(self.spec, self.key, self.gpu)}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[rid]
        return env

    def command(self, env: Mapping[str, str], port: int) -> list[str]:
        """The supervisor's command line: it pins itself to rollout.replica_cpus (REPLICA_CPUS_ENV
        in `env`), if any, then runs the server."""
        cpus = parse_cpu_list(env.get(REPLICA_CPUS_ENV, ""))
        pin = [f"--cpus={format_cpu_list(cpus)}"] if cpus else []
        return [sys.executable, str(SUPERVISOR), str(os.getpid()), *pin, "--",
                *server_command(self.spec, self.host, port, self.gpu)]

    def wait_ready(self, rid: int, client: ReplicaClient) -> int:
        """The supervisor's pid once replica `rid` answers /health; PoolError if it exits or times out."""
        proc = self._procs[rid]
        deadline = time.monotonic() + self.start_timeout_s
        while not client.healthy():
            if proc.poll() is not None:
                raise PoolError(f"replica {rid} exited with code {proc.returncode} while starting; {self.log_tail(rid)}")
            if time.monotonic() > deadline:
                self.kill(rid)
                raise PoolError(f"replica {rid} not ready after {self.start_timeout_s:.0f} s; {self.log_tail(rid)}")
            time.sleep(0.5)
        return proc.pid

    def kill(self, rid: int, grace_s: float = 0.0) -> None:
        """SIGTERM the replica's process group, SIGKILL what is left after `grace_s` (0 = SIGKILL now)."""
        proc = self._procs.get(rid)
        if proc is None:
            return
        if grace_s and proc.poll() is None:
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        signal_group(proc.pid, signal.SIGKILL)  # the group may outlive its leader: always sweep it
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            pass

    def log_tail(self, rid: int, lines: int = 15) -> str:
        try:
            tail = self.log_path(rid).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        return f"log {self.log_path(rid)}:\n" + "\n".join(tail)

    def close(self) -> None:
        for rid in self._procs:
            self.kill(rid)
