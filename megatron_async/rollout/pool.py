"""ReplicaPool: N vLLM replica processes, their health, restarts, and load-aware dispatch.

    with ReplicaPool(ReplicaSpec(model=ckpt_dir), num_replicas=2) as pool:
        records = pool.generate(prompt_token_ids, Sampling(n=4, max_tokens=64, seed=0))
        WeightSender(pool.addresses, pool.authkey).push(version, stage, num_stages, named_tensors)

Dispatch: `generate` cuts the prompts into small chunks on one shared queue; one dispatcher
thread per replica pulls the next chunk when its replica has finished the previous one, so a
faster replica takes more chunks (load-aware, not round robin). Per-prompt seeds are
`seed + prompt index * n` (vLLM seeds completion j of a prompt with its seed + j), so every
completion has its own random stream, independent of which replica serves it.

Versions: every record carries the policy version the replica reported with its answer (read
under the replica's engine lock, so it is the version that generated it). The pool's current
version is the highest any replica has reported. A replica only takes work while it has complete
weights of the current version ("fresh"); one that is behind is "stale" and waits for weights.

Faults: a replica whose connection breaks or whose chunk exceeds `request_timeout_s` is killed
and restarted; its in-flight chunk goes back on the queue (counted in `stats()["requeues"]`) and
another replica takes it. A restarted replica comes back with its checkpoint's weights, so it is
stale as soon as any update has happened; it rejoins only after the learner pushed the current
weights to it (`replicas_needing_weights()` lists who needs them; the pool keeps no weight copy).
The `max_failures + 1`-th failure of one replica raises `PoolError`. Every wait is bounded;
a dispatcher thread's error is re-raised in the caller of `generate`.

Where the processes run: a `LocalLauncher` starts them as this process's children; with
`server=(host, port)` a replica host (`megatron-async serve-replicas`, rollout/host.py) on another
machine starts them, and the pool drives it over TCP. Supervision (failure budget, restarts,
requeues, "stale until re-synced") stays in the pool either way; the host only executes.
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import os
import queue
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_async.config import LOOPBACK_HOSTS
from megatron_async.rollout.host import RemoteLauncher
from megatron_async.rollout.launcher import LocalLauncher, PoolError
from megatron_async.rollout.replica import ReplicaClient, ReplicaError, ReplicaSpec, Sampling


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts passed to generate
    sample_index: int  # 0..n-1 among the prompt's completions
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # completion tokens (a stop token id, if hit, is included)
    logprobs: tuple[float, ...] | None  # log p(token) under the generating weights, per token
    finish_reason: str  # "stop" (eos / stop string / stop token) or "length"
    replica_id: int
    policy_version: int  # version of the weights that generated it


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: int
    address: tuple[str, int]
    pid: int
    version: int
    weights_ok: bool


class _Replica:
    """Pool-side state of one replica (mutated by its dispatcher thread and the pool's methods)."""

    def __init__(self, replica_id: int, port: int):
        self.id, self.port = replica_id, port
        self.pid: int | None = None
        self.incarnation = 0  # bumped per launch: a failure is acted on once per process
        self.gen: ReplicaClient | None = None  # used by the dispatcher thread only
        self.ctl: ReplicaClient | None = None  # health / version, under self.lock
        self.version = 0
        self.weights_ok = True
        self.failures = 0
        self.chunks = 0
        # NOTE: held while restarting and while querying, so a health check never mistakes a
        # replica that another thread is restarting for a dead one.
        self.lock = threading.RLock()


class _Job:
    """One generate call: the chunk queue, the results, the first error."""

    def __init__(self, chunks: list[list[int]], deadline: float):
        self.queue: queue.Queue = queue.Queue()
        for c in chunks:
            self.queue.put(c)
        self.remaining = len(chunks)
        self.results: dict[int, tuple[int, int, list]] = {}  # prompt index -> (replica, version, outputs)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.deadline = deadline

    def done(self, chunk: list[int], replica_id: int, answer: dict) -> None:
        with self.lock:
            for i, outs in zip(chunk, answer["outputs"]):
                self.results[i] = (replica_id, answer["version"], outs)
            self.remaining -= 1
            if self.remaining == 0:
                self.stop.set()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = self.error or error
        self.stop.set()


class ReplicaPool:
    """Start, watch, restart and stop N replicas; dispatch generation over them."""

    def __init__(
        self,
        spec: ReplicaSpec,
        num_replicas: int,
        *,
        host: str = "127.0.0.1",
        authkey: str | bytes | None = None,
        base_port: int = 0,  # 0: each replica binds a free port once and keeps it across restarts
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,  # a chunk slower than this fails its replica
        max_failures: int = 3,  # restarts allowed per replica
        env: dict[str, str] | None = None,  # extra environment for the replica processes
        devices: Sequence[str] | None = None,  # CUDA_VISIBLE_DEVICES per replica (GPU)
        server: tuple[str, int] | None = None,  # a replica host (serve-replicas) starts them; None = here
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if host not in LOOPBACK_HOSTS and not authkey:
            raise ValueError(f"refusing to bind replicas to non-loopback host {host!r} without an explicit authkey (rollout.token)")
        if devices is not None and len(devices) != num_replicas:
            raise ValueError(f"devices has {len(devices)} entries for {num_replicas} replicas")
        if server is not None and (not authkey or env or devices is not None):
            raise ValueError("a replica host needs the shared authkey (rollout.token) and sets env/devices itself")
        self.spec, self.host, self.server = spec, host, server
        self.authkey = (authkey.encode() if isinstance(authkey, str) else authkey) or secrets.token_bytes(32)
        self.start_timeout_s, self.request_timeout_s, self.max_failures = start_timeout_s, request_timeout_s, max_failures
        self.current_version = spec.initial_version
        self.requeues = 0
        self._replicas = [_Replica(i, base_port + i if base_port else 0) for i in range(num_replicas)]
        self._launcher: Any = None if server else LocalLauncher(
            host, self.authkey, Path(log_dir or tempfile.mkdtemp(prefix="replicas-")), start_timeout_s, env, devices)
        self._lock = threading.Lock()  # pool counters and versions
        self._gen_lock = threading.Lock()  # one generate call at a time
        self._started = False

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> "ReplicaPool":
        atexit.register(self.stop)
        self._started = True
        try:
            if self.server is not None:
                self._launcher = RemoteLauncher(self.server, self.authkey, len(self._replicas), self.start_timeout_s)
            for rep in self._replicas:
                self._launch(rep)
            for rep in self._replicas:
                self._wait_ready(rep)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> "ReplicaPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut every replica down (ask, then terminate, then kill); idempotent."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        if self._launcher is None:  # the replica host never answered
            return
        try:
            for rep in self._replicas:
                if rep.pid is not None and self._launcher.exit_code(rep.id) is None and rep.ctl is not None:
                    try:
                        rep.ctl.call("shutdown", wait_s=5.0)
                    except (ConnectionError, TimeoutError, ReplicaError):
                        pass
            for rep in self._replicas:
                self._kill(rep, grace_s=10.0)
        except PoolError as e:  # the replica host is gone, and its replicas with it
            print(f"[pool] stop: {e}", flush=True)
        self._launcher.close()

    def _launch(self, rep: _Replica) -> None:
        self._launcher.start(self.spec, rep.id, rep.port)
        rep.incarnation += 1

    def _wait_ready(self, rep: _Replica) -> None:
        rep.port, rep.pid = self._launcher.wait_ready(rep.id)
        address = (self.host, rep.port)
        rep.gen = ReplicaClient(address, self.authkey, timeout_s=60.0, label=f"replica {rep.id}")
        rep.ctl = ReplicaClient(address, self.authkey, timeout_s=10.0, label=f"replica {rep.id}")
        rep.version, rep.weights_ok = self.spec.initial_version, True

    def _kill(self, rep: _Replica, grace_s: float = 0.0) -> None:
        for client in (rep.gen, rep.ctl):
            if client is not None:
                client.abort()
        self._launcher.kill(rep.id, grace_s)

    def _restart(self, rep: _Replica, failed: int, reason: str) -> None:
        """Replace incarnation `failed` by a new replica process (no-op if another thread already did)."""
        with rep.lock:
            if rep.incarnation != failed:
                return
            self._restart_locked(rep, reason)

    def _restart_locked(self, rep: _Replica, reason: str) -> None:
        rep.failures += 1
        if rep.failures > self.max_failures:
            raise PoolError(
                f"replica {rep.id} failed {rep.failures} times (max_failures={self.max_failures}); "
                f"last failure: {reason}; {self._log_tail(rep)}"
            )
        print(f"[pool] restarting replica {rep.id} (failure {rep.failures}/{self.max_failures}): {reason}", flush=True)
        self._kill(rep)
        self._launch(rep)
        self._wait_ready(rep)

    def _log_tail(self, rep: _Replica) -> str:
        return self._launcher.log_tail(rep.id)

    # -- state ------------------------------------------------------------------------------------
    @property
    def machine(self) -> str:
        """Host name of the machine the replicas run on (loopback addresses work only there)."""
        return self._launcher.machine

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(self.host, rep.port) for rep in self._replicas]

    def pids(self) -> list[int]:
        return [rep.pid for rep in self._replicas]

    def _seen(self, rep: _Replica, status: dict) -> None:
        with self._lock:
            rep.version, rep.weights_ok = status["version"], status.get("weights_ok", True)
            self.current_version = max(self.current_version, rep.version)

    def _query(self, rep: _Replica) -> dict:
        with rep.lock:
            status = rep.ctl.call("health")
        self._seen(rep, status)
        return status

    def _fresh(self, rep: _Replica) -> bool:
        if rep.weights_ok and rep.version >= self.current_version:
            return True
        self._query(rep)
        return rep.weights_ok and rep.version >= self.current_version

    def health_check(self) -> list[dict]:
        """Query every replica, restarting dead or unresponsive ones; returns their status dicts."""
        statuses = []
        for rep in self._replicas:
            with rep.lock:
                try:
                    if (code := self._launcher.exit_code(rep.id)) is not None:
                        raise ConnectionError(f"replica {rep.id} exited with code {code}")
                    statuses.append(self._query(rep))
                except (ConnectionError, TimeoutError) as e:
                    self._restart_locked(rep, str(e))
                    statuses.append(self._query(rep))
        return statuses

    def weights_pushed(self, version: int) -> None:
        """Record that `version` was pushed to the replicas (by a WeightSender, outside the pool).

        NOTE: the pool otherwise learns versions only from the replicas' answers. A replica that
        restarts (back at its checkpoint's version) before any answer carried the pushed version
        would count as fresh and generate with old weights; after this call it is stale.
        """
        with self._lock:
            self.current_version = max(self.current_version, version)

    def replicas_needing_weights(self) -> list[ReplicaInfo]:
        """Replicas that are behind the current version or hold weights of a failed update.

        Runs `health_check` first (so a dead replica is restarted and listed). The learner pushes
        full weights to these addresses; each rejoins dispatch once it reports the current version.
        """
        self.health_check()
        return [
            ReplicaInfo(rep.id, (self.host, rep.port), rep.pid, rep.version, rep.weights_ok)
            for rep in self._replicas
            if not rep.weights_ok or rep.version < self.current_version
        ]

    def stats(self) -> dict:
        return {
            "requeues": self.requeues,
            "restarts": sum(rep.failures for rep in self._replicas),
            "chunks_per_replica": [rep.chunks for rep in self._replicas],
            "current_version": self.current_version,
        }

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        chunk_size: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Completion]:
        """Generate `sampling.n` completions per prompt; records sorted by (prompt, sample) index.

        Raises the first dispatcher error, `PoolError` when a replica exceeds `max_failures`, and
        `TimeoutError` when the whole call exceeds `timeout_s` (default: 2 x request_timeout_s).
        """
        if not self._started:
            raise PoolError("pool is not started (use `with ReplicaPool(...)` or .start())")
        if not prompts:
            return []
        if chunk_size is None:  # ~4 chunks per replica, capped, so faster replicas can take more
            chunk_size = max(1, min(16, math.ceil(len(prompts) / (4 * len(self._replicas)))))
        chunks = [list(range(i, min(i + chunk_size, len(prompts)))) for i in range(0, len(prompts), chunk_size)]
        timeout_s = 2 * self.request_timeout_s if timeout_s is None else timeout_s
        with self._gen_lock:
            job = _Job(chunks, time.monotonic() + timeout_s)
            threads = [threading.Thread(target=self._dispatch, args=(rep, job, prompts, sampling), daemon=True) for rep in self._replicas]
            for t in threads:
                t.start()
            while not job.stop.wait(0.1):
                if time.monotonic() > job.deadline:
                    job.fail(TimeoutError(
                        f"generate: {job.remaining} of {len(chunks)} chunks unfinished after {timeout_s:.0f} s; "
                        f"replica versions {[r.version for r in self._replicas]}, current {self.current_version}, "
                        f"needing weights: {[r.id for r in self._replicas if not r.weights_ok or r.version < self.current_version]}"
                    ))
            if job.error is not None:
                for rep in self._replicas:  # NOTE: wakes dispatchers blocked on an answer
                    rep.gen.abort()
            for t in threads:
                t.join(timeout=self.start_timeout_s + 30.0)
            if job.error is not None:
                raise job.error
        records = []
        for i in range(len(prompts)):
            replica_id, version, outs = job.results[i]
            for j, o in enumerate(outs):
                lps = None if o["logprobs"] is None else tuple(o["logprobs"])
                records.append(Completion(i, j, tuple(prompts[i]), tuple(o["token_ids"]), lps, o["finish_reason"], replica_id, version))
        return records

    def _dispatch(self, rep: _Replica, job: _Job, prompts: Sequence[Sequence[int]], sampling: Sampling) -> None:
        """Dispatcher thread of one replica: pull a chunk, generate, repeat; requeue on failure."""
        try:
            while not job.stop.is_set():
                incarnation = rep.incarnation
                try:
                    fresh = self._fresh(rep)
                except (ConnectionError, TimeoutError) as e:
                    self._restart(rep, incarnation, str(e))
                    continue
                if not fresh:
                    job.stop.wait(0.25)
                    continue
                try:
                    chunk = job.queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                per_prompt = [
                    dataclasses.asdict(sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i * sampling.n))
                    for i in chunk
                ]
                try:
                    answer = rep.gen.call(
                        "generate", prompts=[list(prompts[i]) for i in chunk], sampling=per_prompt,
                        wait_s=self.request_timeout_s, hold_s=self.request_timeout_s / 2,
                    )
                except (ReplicaError, ConnectionError, TimeoutError) as e:
                    if isinstance(e, ReplicaError) and e.kind != "stale":
                        raise  # the request itself is bad (e.g. a prompt longer than max_model_len)
                    job.queue.put(chunk)
                    with self._lock:
                        self.requeues += 1
                    if job.stop.is_set():
                        return
                    if isinstance(e, ReplicaError):
                        rep.weights_ok = False  # re-queried by _fresh before the next chunk
                    else:
                        self._restart(rep, incarnation, str(e))
                    continue
                self._seen(rep, answer)
                rep.chunks += 1
                job.done(chunk, rep.id, answer)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of generate
            job.fail(e)
