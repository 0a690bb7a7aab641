"""ReplicaPool: N vLLM API servers, their health, restarts, weight-update phases and dispatch.

    with ReplicaPool(ReplicaSpec(model=ckpt_dir), num_replicas=2) as pool:
        records = pool.generate(prompt_token_ids, Sampling(n=4, max_tokens=64, seed=0))

Where the servers come from: started here (`LocalLauncher`, one per replica, restarted on
failure), or given as URLs (`urls=`, `rollout.replica_urls`: servers started by any launcher,
e.g. an `srun` line; not restarted by us, re-synced when they answer again).

Generation (`generate`): one `/inference/v1/generate` request per prompt (token ids in, K
completions with token ids, logprobs and weight-version spans out), all of a batch in flight at
once so vLLM batches continuously. Each request goes to the fresh replica with the fewest
outstanding sequences, up to `max_inflight_seqs` per replica; the rest wait client-side and go
out as completions return, so a faster replica takes more. Prompt i is seeded `seed + i * n`
(vLLM seeds completion j with its seed + j): every completion has its own random stream,
independent of which replica serves it, so a run is reproducible and resumable.

Versions: every completion carries the range of policy versions its tokens were sampled under
(vLLM's `weight_versions` spans): `policy_version` is the oldest (the lag bound uses it),
`policy_version_max` the newest. A replica takes work only while fresh: alive, with complete
weights of the pool's current version.

Weight updates (`begin_update` / `finish_update`, called by learner rank 0 around the stage
senders' buckets, weights/update.py), in one of two modes:
- "between_batches" (the paper's; the default): wait for the running `generate` to return,
  hold new ones, `/pause?mode=wait` (caches cleared), `/start_weight_update` ... buckets ...
  `/finish_weight_update` (sets `weight_version`), `/resume`; no completion spans two versions.
- "during_generation" (PipelineRL's): `/pause?mode=keep` freezes running requests where they
  are; after the update they go on under the new weights, and their spans show it. Prefix caching
  is off in this mode (a cached prompt's KV would outlive its weights).
A replica failing any phase is dropped from that update (not fresh until a later full one).

Faults: a request whose connection breaks, that a replica refuses with 503 or that exceeds
`request_timeout_s` goes back to the queue (`stats()["requeues"]`) and another replica takes it.
A broken connection to a replica that still answers `/health` costs only the requeue; so does a
503 from one that still answers (vLLM >= 0.33 refuses new requests with 503 while paused: a
request racing a pause, or a pause by another client), and that replica takes no new request for
`RETRY_AFTER_S`. Otherwise (and on a timeout) the replica is
marked down and, if started here, restarted in the background (killed as a process group first), up to
`max_failures` times (then `PoolError`). A restarted replica holds its checkpoint's weights: it
rejoins dispatch only after the learner pushed the current version to it
(`replicas_needing_weights()`). That push is a re-sync of its own: the learner's senders still
hold the group or delta base of its previous process, so a full update leaves out every replica
that came back from a failure until a re-sync (which has the senders forget it: a whole push
through a fresh group) opened on it. While no replica is fresh, prompts wait; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import httpx
import torch

from megatron_async.transports import LOOPBACK_HOSTS
from megatron_async.rollout.launcher import LocalLauncher, PoolError, free_port
from megatron_async.rollout.replica import (GENERATE_ROUTE, ReplicaClient, ReplicaError, ReplicaSpec, Sampling, auth_headers,
                                            parse_version)
from megatron_async.sample import Sample

log = logging.getLogger(__name__)

UpdateMode = Literal["between_batches", "during_generation"]
RETRY_AFTER_S = 1.0  # a replica that answered 503 (paused) but is alive takes no new request for this long


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: int
    url: str
    pid: int | None
    version: int
    weights_ok: bool


class _Replica:
    """Pool-side state of one replica (guarded by the pool's lock)."""

    def __init__(self, rid: int, url: str, client: ReplicaClient, port: int | None):
        self.id, self.url, self.client, self.port = rid, url, client, port
        self.pid: int | None = None
        self.up = False  # answering; False from a failure until restarted (or, for a URL, answering again)
        self.version = 0
        self.weights_ok = True  # False after a failed update until a full one succeeds
        self.inflight = 0  # sequences outstanding
        self.failures = 0
        self.requests = 0
        self.restarting = False
        # up again after a failure: what the learner's senders keep for it (a group, a delta base)
        # belongs to its previous process, so only a re-sync (which forgets that) may update it
        self.needs_resync = False
        self.error = ""  # why its last restart or reconnect failed
        self.retry_at = 0.0  # time.monotonic() before which it takes no new request (it answered 503)


class ReplicaPool:
    """Start (or connect to), watch, restart and stop N replicas; dispatch generation over them."""

    def __init__(
        self,
        spec: ReplicaSpec,
        num_replicas: int = 1,
        *,
        urls: Sequence[str] = (),  # servers started elsewhere: used instead of starting num_replicas
        host: str = "127.0.0.1",
        key: str | None = None,
        base_port: int = 0,  # 0: each replica gets a free port once and keeps it across restarts
        log_dir: str | Path | None = None,
        start_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,  # a request slower than this fails its replica
        max_failures: int = 3,  # restarts allowed per replica
        max_inflight_seqs: int = 256,  # per replica (vLLM's default max_num_seqs)
        env: dict[str, str] | None = None,  # extra environment of the servers started here
        devices: Sequence[str] | None = None,  # CUDA_VISIBLE_DEVICES per replica (GPU)
    ):
        count = len(urls) or num_replicas
        if count < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if host not in LOOPBACK_HOSTS and not key:
            raise ValueError(f"refusing to serve replicas on non-loopback host {host!r} without an explicit key (rollout.token)")
        if urls and not key:
            raise ValueError("replica_urls: servers started elsewhere need the key they were started with (rollout.token)")
        if devices is not None and len(devices) != count:
            raise ValueError(f"devices has {len(devices)} entries for {count} replicas")
        self.spec, self.key = spec, key or secrets.token_hex(32)
        self.start_timeout_s, self.request_timeout_s, self.max_failures = start_timeout_s, request_timeout_s, max_failures
        self.max_inflight_seqs = max_inflight_seqs
        self.current_version = spec.initial_version
        self.requeues = 0
        self.gpu = torch.cuda.is_available()
        self._launcher = None if urls else LocalLauncher(
            spec, host, self.key, Path(log_dir or tempfile.mkdtemp(prefix="replicas-")), start_timeout_s, self.gpu, env,
            devices)
        addresses: list[tuple[str, int | None]]
        if urls:
            addresses = [(u.rstrip("/"), None) for u in urls]
        else:
            ports = [base_port + i if base_port else free_port(host) for i in range(count)]
            addresses = [(f"http://{host}:{p}", p) for p in ports]
        self._replicas = [_Replica(i, url, ReplicaClient(url, self.key, timeout_s=30.0, label=f"replica {i}"), port)
                          for i, (url, port) in enumerate(addresses)]
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a replica became fresh, or an update ended
        self._generating = False
        self._update_open = False  # between begin_update and finish_update
        self._restarts = ThreadPoolExecutor(max_workers=count, thread_name_prefix="replica-restart")
        self._control = ThreadPoolExecutor(max_workers=count, thread_name_prefix="replica-control")
        self._started = False

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> "ReplicaPool":
        atexit.register(self.stop)
        self._started = True
        try:
            if self._launcher is not None:
                for rep in self._replicas:
                    self._launch(rep)
            for rep in self._replicas:
                self._came_up(rep)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> "ReplicaPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every replica started here (SIGTERM, then SIGKILL of its process group); idempotent."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.stop)
        self._restarts.shutdown(wait=False, cancel_futures=True)
        if self._launcher is not None:
            for rep in self._replicas:
                self._launcher.kill(rep.id, grace_s=10.0)
        for rep in self._replicas:
            rep.client.close()

    def _launch(self, rep: _Replica, *, restart: bool = False) -> None:
        """Start `rep`'s server here (`restart`: kill its old one first)."""
        launcher, port = self._launcher, rep.port
        if launcher is None or port is None:
            raise PoolError(f"replica {rep.id} at {rep.url} was started elsewhere: this pool cannot start it")
        if restart:
            launcher.kill(rep.id)
        launcher.start(rep.id, port)

    def _came_up(self, rep: _Replica, recovered: bool = False) -> None:
        """Wait until `rep` answers, then label its weights with the checkpoint's version.

        `recovered`: up again after a failure (restarted here, or a server started elsewhere
        answering again): it waits for a re-sync (`needs_resync`, `begin_update`). A server started
        elsewhere that restarted (no version set) holds whatever its launcher loaded (e.g. the base
        model, not `spec.model`): not fresh until the learner pushed the current weights to it."""
        if self._launcher is not None:
            rep.pid = self._launcher.wait_ready(rep.id, rep.client)
        else:
            deadline = time.monotonic() + self.start_timeout_s
            while not rep.client.healthy():
                if time.monotonic() > deadline or not self._started:
                    raise PoolError(f"replica {rep.id} at {rep.url} not answering after {self.start_timeout_s:.0f} s"
                                    if self._started else "pool stopped")
                time.sleep(1.0)
            if missing := rep.client.missing_for(self.spec.weight_backend):
                raise PoolError(
                    f"replica {rep.id} at {rep.url} cannot take this run's weight updates; it lacks "
                    f"{'; '.join(missing)}. Start a compatible one with `megatron-async serve-replica CONFIG --index "
                    f"{rep.id}` (vLLM with this package installed: its plugin's engines, dev mode, the scale-out route)")
        version = rep.client.version(default=-1)
        restarted = version < 0
        if restarted:  # a fresh server: its weights are the checkpoint's
            rep.client.set_version(self.spec.initial_version)
            version = self.spec.initial_version
        elsewhere_restarted = recovered and restarted and self._launcher is None
        with self._changed:
            rep.version, rep.weights_ok, rep.up, rep.restarting = version, not elsewhere_restarted, True, False
            rep.needs_resync = recovered
            self._changed.notify_all()

    def _failed(self, rep: _Replica, reason: str) -> None:
        """Take `rep` out of dispatch and (if started here) restart it in the background (not once
        the pool is stopped)."""
        with self._lock:
            if not rep.up or rep.restarting or not self._started:
                return
            rep.up = False
            rep.failures += 1
            if rep.failures > self.max_failures:
                return  # `_check_budget` raises in the caller
            if self._launcher is None:
                log.warning("replica %d at %s failed: %s; waiting for it to answer again", rep.id, rep.url, reason)
                rep.restarting = True
                self._restarts.submit(self._reconnect, rep)
                return
            log.warning("restarting replica %d (failure %d/%d): %s", rep.id, rep.failures, self.max_failures, reason)
            rep.restarting = True
        self._restarts.submit(self._restart, rep)

    def _restart(self, rep: _Replica) -> None:
        try:
            self._launch(rep, restart=True)
            self._came_up(rep, recovered=True)
        except BaseException as e:  # noqa: BLE001 - counted as one more failure
            with self._lock:
                rep.restarting, rep.failures = False, max(rep.failures, self.max_failures + 1)
                rep.error = f"restart failed: {e}"

    def _reconnect(self, rep: _Replica) -> None:
        try:
            self._came_up(rep, recovered=True)
        except BaseException as e:  # noqa: BLE001 - recorded; _check_budget raises in the caller
            with self._lock:
                rep.restarting, rep.error = False, f"{rep.url} did not answer again: {e}"

    def _check_budget(self) -> None:
        for rep in self._replicas:
            if rep.failures > self.max_failures or (not rep.up and not rep.restarting):
                raise PoolError(f"replica {rep.id} failed {rep.failures} times (max_failures={self.max_failures}) "
                                f"{rep.error}; {self.log_tail(rep.id)}")

    # -- state ------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [rep.url for rep in self._replicas]

    def pids(self) -> list[int | None]:
        return [rep.pid for rep in self._replicas]

    def log_tail(self, replica_id: int, lines: int = 15) -> str:
        """The last lines of a replica's server log (replicas started here; "" for URL replicas)."""
        return "" if self._launcher is None else self._launcher.log_tail(replica_id, lines)

    def _fresh(self, rep: _Replica) -> bool:
        return rep.up and rep.weights_ok and rep.version >= self.current_version

    def health_check(self) -> list[dict]:
        """Ask every replica that is up whether it still answers (a dead one is restarted); statuses."""
        self._check_budget()
        for rep in self._replicas:
            if rep.up and not rep.client.healthy():
                self._failed(rep, "not answering /health")
        return [{"replica_id": r.id, "up": r.up, "version": r.version, "weights_ok": r.weights_ok} for r in self._replicas]

    def replicas_needing_weights(self, wait_s: float | None = None) -> list[ReplicaInfo]:
        """Replicas that are up but behind the current version, hold weights of a failed update, or
        came back from a failure (`needs_resync`): each needs a re-sync (`begin_update` with its id).

        Waits (up to `wait_s`, default the start timeout) for restarting replicas to come up,
        so that the learner can push the current weights to them.
        """
        self.health_check()
        deadline = time.monotonic() + (self.start_timeout_s if wait_s is None else wait_s)
        with self._changed:
            while any(r.restarting for r in self._replicas) and time.monotonic() < deadline:
                self._changed.wait(0.5)
        self._check_budget()
        return [ReplicaInfo(r.id, r.url, r.pid, r.version, r.weights_ok) for r in self._replicas
                if r.up and (r.needs_resync or not r.weights_ok or r.version < self.current_version)]

    def up(self, replica_ids: Sequence[int]) -> list[int]:
        """Those of `replica_ids` that are up (answering, not restarting)."""
        return [r.id for r in self._replicas if r.id in replica_ids and r.up]

    def stats(self) -> dict:
        return {
            "requeues": self.requeues,
            "restarts": sum(r.failures for r in self._replicas) if self._launcher is not None else 0,
            "requests_per_replica": [r.requests for r in self._replicas],
            "current_version": self.current_version,
        }

    # -- weight updates ---------------------------------------------------------------------------
    def begin_update(self, replica_ids: Sequence[int] | None, mode: UpdateMode, timeout_s: float) -> list[int]:
        """Pause the target replicas and open a weight update on each; returns those that opened.

        A full update (`replica_ids` None) "between_batches" first waits (up to `timeout_s`) for a
        running `generate` to return; new ones wait until `finish_update`. (The producer already
        pushes only between batches; this keeps the pool's own guarantee.) A re-sync of restarted
        replicas never waits: they serve nothing until it ends.

        A full update leaves out the replicas that came back from a failure (`needs_resync`): the
        senders still hold the group or delta base of their previous process, and only a re-sync
        (`replica_ids` given: weights/update.py has the senders `forget` them first) is sent whole
        through a fresh group. A re-sync that opens on a replica clears its flag.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            if mode == "between_batches" and replica_ids is None:
                while self._generating:
                    if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                        raise TimeoutError(f"weight update: generation still running after {timeout_s:.0f} s")
            self._update_open = True
            targets = [r for r in self._replicas if r.up and (
                not r.needs_resync if replica_ids is None else r.id in replica_ids)]
        pause = "wait" if mode == "between_batches" else "keep"

        def open_one(rep: _Replica) -> None:
            rep.client.pause(pause)
            try:
                rep.client.start_weight_update()
            except (ConnectionError, TimeoutError, ReplicaError):
                try:  # not left paused: requests frozen by "keep" go on under the old weights
                    rep.client.resume()
                except (ConnectionError, TimeoutError, ReplicaError) as e:
                    log.warning("replica %d: /resume after a failed /start_weight_update failed too: %s", rep.id, e)
                raise
            if replica_ids is not None:
                with self._lock:
                    rep.needs_resync = False

        return self._on_each(targets, open_one, "begin")

    def finish_update(self, version: int, complete: Sequence[int], abandoned: Sequence[int] = ()) -> list[int]:
        """Publish `version` on the `complete` replicas (every stage's buckets arrived) and resume
        them; close the update without a version on the `abandoned` ones (a stage failed there:
        they stay out of dispatch until a later full update). Returns the replicas that published."""

        def publish(rep: _Replica) -> None:
            rep.client.verify_weight_update()  # every one of our engines checks the update's coverage
            rep.client.finish_weight_update(version)
            rep.client.resume()
            with self._lock:
                rep.version, rep.weights_ok = version, True

        def abandon(rep: _Replica) -> None:
            with self._lock:
                rep.weights_ok = False
            try:  # NOTE: fails when the failed bucket already closed vLLM's update session; harmless
                rep.client.finish_weight_update(None)
            except ReplicaError:
                pass
            rep.client.resume()

        with self._changed:
            self.current_version = max(self.current_version, version)  # the others are stale from here
        try:
            published = self._on_each([r for r in self._replicas if r.id in complete], publish, "finish")
            closing = [r for r in self._replicas if r.up and (r.id in abandoned or (r.id in complete and r.id not in published))]
            self._on_each(closing, abandon, "abandon")
            return published
        finally:
            with self._changed:
                self._update_open = False
                self._changed.notify_all()

    def _on_each(self, targets: list[_Replica], action, phase: str) -> list[int]:
        ok = []
        futures = [(rep, self._control.submit(action, rep)) for rep in targets]
        for rep, fut in futures:
            try:
                fut.result()
                ok.append(rep.id)
            except (ConnectionError, TimeoutError) as e:
                self._failed(rep, f"weight update ({phase}): {e}")
            except ReplicaError as e:
                log.warning("replica %d dropped from the weight update (%s): %s", rep.id, phase, e)
                with self._lock:
                    rep.weights_ok = False
        return ok

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, timeout_s: float | None = None) -> list[Sample]:
        """`sampling.n` completions per prompt, as `Sample`s without a reward, sorted by (prompt, sample) index.

        Raises `PoolError` when a replica exceeds `max_failures`, `ReplicaError` for a request a
        replica refuses as bad (e.g. a prompt longer than max_model_len), and `TimeoutError`
        when the whole call exceeds `timeout_s` (default: 2 x request_timeout_s).
        """
        if not self._started:
            raise PoolError("pool is not started (use `with ReplicaPool(...)` or .start())")
        if not prompts:
            return []
        timeout_s = 2 * self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._generating or self._update_open:  # one call at a time; between-batch updates first
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"generate: waited {timeout_s:.0f} s for a weight update or another generate call")
            self._generating = True
        try:
            return asyncio.run(self._generate(prompts, sampling, deadline, timeout_s))
        finally:
            with self._changed:
                self._generating = False
                self._changed.notify_all()

    def _pick(self, n: int) -> _Replica | None:
        """The fresh replica with the fewest outstanding sequences and room for `n` more."""
        now = time.monotonic()
        with self._lock:
            fresh = [r for r in self._replicas if self._fresh(r) and r.retry_at <= now
                     and (r.inflight == 0 or r.inflight + n <= self.max_inflight_seqs)]
            if not fresh:
                return None
            rep = min(fresh, key=lambda r: r.inflight)
            rep.inflight += n
            return rep

    async def _generate(self, prompts, sampling: Sampling, deadline: float, timeout_s: float) -> list[Sample]:
        pending = collections.deque(range(len(prompts)))
        results: dict[int, tuple[int, list[dict]]] = {}
        running: dict[asyncio.Task, tuple[_Replica, int]] = {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(headers=auth_headers(self.key), timeout=self.request_timeout_s,
                                     limits=limits, trust_env=False) as http:
            try:
                while len(results) < len(prompts):
                    if not self._started:
                        raise PoolError(f"pool stopped with {len(prompts) - len(results)} of {len(prompts)} prompts "
                                        "unfinished")
                    while pending and (rep := self._pick(sampling.n)) is not None:
                        i = pending.popleft()
                        seed = None if sampling.seed is None else sampling.seed + i * sampling.n
                        body = {"token_ids": list(prompts[i]), "sampling_params": sampling.params(seed)}
                        running[asyncio.ensure_future(http.post(rep.url + GENERATE_ROUTE, json=body))] = (rep, i)
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"generate: {len(prompts) - len(results)} of {len(prompts)} prompts unfinished after "
                            f"{timeout_s:.0f} s; replicas {[(r.id, r.up, r.version) for r in self._replicas]}, "
                            f"current version {self.current_version}")
                    if not running:
                        self._check_budget()
                        await asyncio.sleep(0.25)  # no replica is fresh: wait for a restart or a weight push
                        continue
                    done, _ = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        rep, i = running.pop(task)
                        with self._lock:
                            rep.inflight -= sampling.n
                        error = self._outcome(task, rep)
                        if error is None:
                            results[i] = (rep.id, task.result().json()["choices"])
                            rep.requests += 1
                        else:
                            pending.appendleft(i)
                            self.requeues += 1
                            if self._refused_busy(task) and await self._answers(http, rep):
                                log.info("replica %d: %s; it answers /health (paused, or at its queue limit): "
                                         "request requeued, replica kept, new requests after %.1f s", rep.id, error,
                                         RETRY_AFTER_S)
                                with self._lock:
                                    rep.retry_at = time.monotonic() + RETRY_AFTER_S
                            elif self._connection_dropped(task) and await self._answers(http, rep):
                                log.warning("replica %d: %s; it answers /health: request requeued, replica kept", rep.id, error)
                            else:
                                self._failed(rep, error)
            finally:
                for task in running:
                    task.cancel()
                for rep, _ in running.values():
                    with self._lock:
                        rep.inflight -= sampling.n
        return [record for i in range(len(prompts)) for record in self._records(i, prompts[i], *results[i])]

    def _outcome(self, task: asyncio.Task, rep: _Replica) -> str | None:
        """None for an answer; the reason to requeue for a lost connection or a dead engine; raises
        for a request the replica refuses (4xx: requeueing it would fail again)."""
        if (e := task.exception()) is not None:
            if isinstance(e, (httpx.TransportError, httpx.TimeoutException)):
                return f"request failed: {e!r}"
            raise e
        r = task.result()
        if r.status_code == 200:
            return None
        if 400 <= r.status_code < 500:
            raise ReplicaError(f"replica {rep.id} refused a request ({r.status_code}): {r.text[:500]}", r.status_code)
        return f"answered {r.status_code}: {r.text[:200]}"

    @staticmethod
    def _refused_busy(task: asyncio.Task) -> bool:
        """The replica answered 503: paused (vLLM >= 0.33 refuses new requests until /resume), at
        its queue limit (--max-num-queued-reqs), or its engine is dead (vLLM answers 503 for
        EngineDeadError too): `_answers` tells the last from the others."""
        return task.exception() is None and task.result().status_code == 503

    @staticmethod
    def _connection_dropped(task: asyncio.Task) -> bool:
        """The request's connection broke (not a timeout, not an answer): the server may have died,
        or only this connection (a reset under load): `_answers` tells which."""
        e = task.exception()
        return isinstance(e, httpx.TransportError) and not isinstance(e, httpx.TimeoutException)

    async def _answers(self, http: httpx.AsyncClient, rep: _Replica) -> bool:
        """Whether `rep` still answers `/health` (200: API server and engine alive), within 30 s."""
        try:
            return (await http.get(rep.url + "/health", timeout=30.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _records(self, i: int, prompt: Sequence[int], replica_id: int, choices: list[dict]) -> list[Sample]:
        out = []
        for choice in sorted(choices, key=lambda c: c["index"]):
            tokens = tuple(choice["token_ids"])
            content = (choice.get("logprobs") or {}).get("content")
            lps = None if content is None else tuple(float(c["logprob"]) for c in content)
            spans = choice.get("weight_versions") or [{"version": str(self.spec.initial_version)}]
            versions = [parse_version(s["version"], self.spec.initial_version) for s in spans]
            out.append(Sample(prompt_index=i, prompt_token_ids=tuple(prompt), token_ids=tokens, logprobs=lps, reward=None,
                              policy_version=min(versions), sample_index=choice["index"],
                              finish_reason=choice.get("finish_reason") or "stop", replica_id=replica_id,
                              policy_version_max=max(versions)))
        return out
