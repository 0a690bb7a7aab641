"""Replica host: starts a dedicated replica node's vLLM replicas for a learner on other nodes.

    megatron-async serve-replicas CONFIG [overrides]     # on placement.replica_node (SLURM: srun)

With `placement.dedicated_replica_node: true` the replica node runs no learner ranks. This process
listens on `rollout.host:placement.replica_server_port` (authkey `rollout.token`), and learner rank
0's `ReplicaPool(server=...)` drives it through a `RemoteLauncher`: start replica i, wait until it
serves, is it alive, kill it, its log tail. The replicas are the same `python -m
megatron_async.rollout.replica` processes as on a shared node (`pool.LocalLauncher` starts them
here, on this node's `placement.replica_gpus`), and the learner talks to them directly: the pool
for generation, every pipeline stage's sender for weights.

NOTE: supervision stays in the pool, not here. A restarted replica holds its checkpoint's weights
and may serve only after the learner pushed the current version (`replicas_needing_weights`);
the failure budget and the requeue of in-flight chunks are the pool's; a second supervisor here
would race it to restart the same replica. This host only executes.

Life cycle: the pool's first request ("hello", on its session connection) starts the session.
When that connection closes (the pool stopped, or learner rank 0 died: the kernel closes its
sockets; a vanished machine is noticed by TCP keepalive in about a minute) the host kills its
replicas and exits; it also exits if no learner connects within `wait_s`. Its replicas exit with
it (they watch their parent). If the host dies, the pool's next request raises `PoolError`.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from megatron_async.cluster.cpu_affinity import replica_pin_env
from megatron_async.cluster.placement import check_replica_host, replica_devices
from megatron_async.config import ConfigError
from megatron_async.rollout.launcher import LocalLauncher, PoolError, replica_env
from megatron_async.rollout.replica import (
    STALL_TIMEOUT_S,
    ReplicaClient,
    ReplicaError,
    ReplicaSpec,
    _set_socket_timeouts,
)


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle peer after 30 s, every 10 s, give up after 3 misses: a dead machine shows in ~1 min."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class ReplicaHost:
    """Serves `LocalLauncher` requests from one learner session (see the module docstring)."""

    def __init__(self, launcher: LocalLauncher, num_replicas: int, authkey: bytes):
        self.launcher, self.num_replicas, self.authkey = launcher, num_replicas, authkey
        self.session = threading.Event()  # a learner said hello
        self.ended = threading.Event()  # its session connection closed, or it asked to shut down
        self._lock = threading.Lock()

    def serve_connection(self, conn: Connection) -> None:
        is_session = False
        try:
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                _set_socket_timeouts(sock, STALL_TIMEOUT_S)  # bounds the handshake and each message
                _keepalive(sock)
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            while not self.ended.is_set():
                if not conn.poll(1.0):
                    continue
                req = conn.recv()
                try:
                    answer = {"ok": True, **self._dispatch(req)}
                except Exception as e:  # noqa: BLE001 - reported to the pool, which raises PoolError
                    answer = {"ok": False, "error": str(e), "kind": "host"}
                if req.get("op") == "hello" and answer["ok"]:
                    is_session = True
                conn.send(answer)
                if req.get("op") == "shutdown":
                    self.ended.set()
        except (EOFError, OSError, AuthenticationError) as e:
            if isinstance(e, AuthenticationError):
                print(f"[replica-host] rejected a connection: {e}", flush=True)
            elif is_session:
                print(f"[replica-host] the learner's session connection broke: {e!r}", flush=True)
        finally:
            conn.close()
            if is_session:
                self.ended.set()

    def _dispatch(self, req: dict) -> dict:
        op = req.get("op")
        if op == "hello":
            with self._lock:
                if self.session.is_set():
                    raise PoolError("another learner session is already connected to this replica host")
                if req["num_replicas"] != self.num_replicas:
                    raise PoolError(f"the learner asks for {req['num_replicas']} replicas, this host was started with "
                                    f"rollout.num_replicas={self.num_replicas}: run both with the same config")
                self.launcher.start_timeout_s = req["start_timeout_s"]
                self.session.set()
            print(f"[replica-host] learner session from pid {req['pid']} on {req['machine']}", flush=True)
            return {"machine": self.launcher.machine, "pid": os.getpid()}
        if op == "shutdown":
            return {}
        rid = req["replica_id"]
        if not self.session.is_set() or not 0 <= rid < self.num_replicas:
            raise PoolError(f"bad request {op!r} for replica {rid} (no session, or not in [0, {self.num_replicas}))")
        if op == "start":
            self.launcher.start(ReplicaSpec(**req["spec"]), rid, req["port"])
            return {}
        if op == "wait_ready":
            port, pid = self.launcher.wait_ready(rid)
            print(f"[replica-host] replica {rid} serves on {self.launcher.host}:{port} (pid {pid})", flush=True)
            return {"port": port, "pid": pid}
        if op == "exit_code":
            return {"code": self.launcher.exit_code(rid)}
        if op == "kill":
            self.launcher.kill(rid, req["grace_s"])
            return {}
        if op == "log_tail":
            return {"text": self.launcher.log_tail(rid)}
        raise PoolError(f"unknown op {op!r}")


def main(cfg, wait_s: float) -> int:
    """`megatron-async serve-replicas`: serve this node's replicas until the learner's session ends."""
    try:
        check_replica_host(cfg)
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", flush=True)
        return 2
    r, port = cfg.rollout, cfg.placement.replica_server_port
    authkey = r.token.encode()
    launcher = LocalLauncher(r.host, authkey, cfg.run_dir / "replicas", start_timeout_s=300.0,
                             env={**replica_env(), **replica_pin_env(r.replica_cpus)}, devices=replica_devices(cfg))
    host = ReplicaHost(launcher, r.num_replicas, authkey)
    # NOTE: the handshake runs in each connection's thread, so a stalled stranger blocks no one.
    listener = Listener((r.host, port), family="AF_INET")

    def accept_loop():
        while not host.ended.is_set():
            try:
                conn = listener.accept()
            except OSError:  # the listener was closed
                return
            threading.Thread(target=host.serve_connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    print(f"[replica-host] {socket.gethostname()} pid {os.getpid()}: waiting on {r.host}:{port} for learner rank 0 "
          f"({r.num_replicas} replicas, logs in {launcher.log_dir})", flush=True)
    try:
        if not host.session.wait(wait_s):
            print(f"[replica-host] no learner connected within {wait_s:.0f} s (--wait-s); exiting", flush=True)
            return 1
        host.ended.wait()
        print("[replica-host] the learner's session ended: stopping the replicas", flush=True)
        return 0
    finally:
        listener.close()
        launcher.close()


class RemoteLauncher:
    """The pool's side of a replica host: `LocalLauncher`'s methods, each one request to the host.

    One connection per replica (a replica starting for minutes does not block the others' checks)
    and one session connection, whose closing tells the host that the learner is gone. Any
    failure to reach the host is final: `PoolError` naming the host, now and on every later call.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, num_replicas: int, start_timeout_s: float):
        self.label = f"replica host at {address[0]}:{address[1]}"
        self.start_timeout_s = start_timeout_s
        self._gone = ""
        self._session = ReplicaClient(address, authkey, timeout_s=30.0, label=self.label)
        self._clients = [ReplicaClient(address, authkey, timeout_s=30.0, label=self.label) for _ in range(num_replicas)]
        self._locks = [threading.Lock() for _ in range(num_replicas + 1)]  # per client; the last: the session
        hello = dict(num_replicas=num_replicas, start_timeout_s=start_timeout_s, pid=os.getpid(), machine=socket.gethostname())
        deadline = time.monotonic() + start_timeout_s
        while True:  # NOTE: the host may still be starting (srun starts both sides at once)
            try:
                answer = self._session.call("hello", **hello)
                break
            except ConnectionError as e:
                if "cannot connect" not in str(e) or time.monotonic() > deadline:
                    raise PoolError(f"{self.label} (megatron-async serve-replicas on placement.replica_node) "
                                    f"did not answer within {start_timeout_s:.0f} s: {e}") from e
                time.sleep(1.0)
            except ReplicaError as e:
                raise PoolError(str(e)) from e
        self.machine = answer["machine"]

    def _call(self, rid: int | None, op: str, wait_s: float | None = None, **fields) -> dict:
        if self._gone:
            raise PoolError(self._gone)
        client = self._session if rid is None else self._clients[rid]
        with self._locks[-1 if rid is None else rid]:
            try:
                return client.call(op, wait_s=wait_s, **({} if rid is None else {"replica_id": rid}), **fields)
            except (ConnectionError, TimeoutError) as e:
                self._gone = (f"{self.label} is gone ({e}); its replicas went with it. See the serve-replicas output "
                              "on placement.replica_node")
                raise PoolError(self._gone) from e
            except ReplicaError as e:
                raise PoolError(str(e)) from e

    def start(self, spec: ReplicaSpec, rid: int, port: int) -> None:
        self._call(rid, "start", spec=asdict(spec), port=port)

    def wait_ready(self, rid: int) -> tuple[int, int]:
        answer = self._call(rid, "wait_ready", wait_s=self.start_timeout_s + 30.0)
        return answer["port"], answer["pid"]

    def exit_code(self, rid: int) -> int | None:
        return self._call(rid, "exit_code")["code"]

    def kill(self, rid: int, grace_s: float = 0.0) -> None:
        self._call(rid, "kill", wait_s=grace_s + 30.0, grace_s=grace_s)

    def log_tail(self, rid: int) -> str:
        try:
            return self._call(rid, "log_tail")["text"]
        except PoolError as e:
            return f"(no log: {e})"

    def close(self) -> None:
        """End the session: the host stops its replicas and exits."""
        if not self._gone:
            try:
                self._call(None, "shutdown", wait_s=10.0)
            except PoolError:
                pass
        for client in (self._session, *self._clients):
            client.close()
