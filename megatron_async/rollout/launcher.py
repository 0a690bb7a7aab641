"""Where replica processes come from: `LocalLauncher` starts them as this process's children (for
the pool, or for a replica host's `serve-replicas`), with the environment `replica_env` gives them.

The pool (`pool.py`) supervises; a launcher only starts, reports, kills and shows logs. The
remote counterpart, `host.RemoteLauncher`, has the same methods.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from megatron_async.rollout.replica import ReplicaSpec, launch_config


def replica_env() -> dict[str, str]:
    """Environment of replica processes: on CPU, vLLM in single-process mode (2 s start-up)."""
    env = {}
    if not torch.cuda.is_available():
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    return env


TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}


class PoolError(RuntimeError):
    """The pool cannot go on: a replica failed too often, could not start, or no work finished in time."""


class LocalLauncher:
    """Replica processes on this machine: the pool's own children, or a replica host's.

    Each gets its launch config (with the authkey) on stdin and reports its port through a ready
    file; its output goes to `log_dir/replica<i>.log`.
    """

    def __init__(self, host: str, authkey: bytes, log_dir: Path, start_timeout_s: float,
                 env: dict[str, str] | None = None, devices: Sequence[str] | None = None):
        self.host, self.authkey, self.log_dir, self.start_timeout_s = host, authkey, Path(log_dir), start_timeout_s
        self.env, self.devices = dict(env or {}), devices
        self.machine = socket.gethostname()  # where the replicas run (reachability checks)
        self._procs: dict[int, subprocess.Popen] = {}

    def _paths(self, rid: int) -> tuple[Path, Path]:
        return self.log_dir / f"replica{rid}.log", self.log_dir / f"replica{rid}.ready"

    def start(self, spec: ReplicaSpec, rid: int, port: int) -> None:
        log_path, ready = self._paths(rid)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        # NOTE: a pool owned by a torchrun rank must not hand its rendezvous variables (RANK,
        # MASTER_PORT, ...) to the replica, whose vLLM sets up its own torch.distributed world.
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
        env.update(self.env)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[rid]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_async.rollout.replica"],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        self._procs[rid] = proc
        proc.stdin.write(launch_config(spec, rid, self.host, port, self.authkey, str(ready)).encode())
        proc.stdin.close()

    def wait_ready(self, rid: int) -> tuple[int, int]:
        """(port, pid) once replica `rid` serves; PoolError if it exits or times out while starting."""
        proc, (_, ready) = self._procs[rid], self._paths(rid)
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise PoolError(f"replica {rid} exited with code {proc.returncode} while starting; {self.log_tail(rid)}")
            if time.monotonic() > deadline:
                self.kill(rid)
                raise PoolError(f"replica {rid} not ready after {self.start_timeout_s:.0f} s; {self.log_tail(rid)}")
            time.sleep(0.1)
        return int(json.loads(ready.read_text())["port"]), proc.pid

    def exit_code(self, rid: int) -> int | None:
        """None while replica `rid`'s process runs."""
        return self._procs[rid].poll()

    def kill(self, rid: int, grace_s: float = 0.0) -> None:
        """Give the process `grace_s` to exit (after a shutdown request), then terminate; 0 = SIGKILL now."""
        proc = self._procs.get(rid)
        if proc is None or proc.poll() is not None:
            return
        if grace_s:
            try:
                proc.wait(grace_s)
                return
            except subprocess.TimeoutExpired:
                proc.terminate()
            try:
                proc.wait(5.0)
                return
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait(5.0)

    def log_tail(self, rid: int, lines: int = 15) -> str:
        log_path = self._paths(rid)[0]
        try:
            tail = log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        return f"log {log_path}:\n" + "\n".join(tail)

    def close(self) -> None:
        for rid in self._procs:
            self.kill(rid)
