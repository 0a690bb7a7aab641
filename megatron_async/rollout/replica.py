"""One vLLM replica: an `LLM` engine in its own OS process, served over an authenticated socket.

Started by `ReplicaPool` as `python -m megatron_async.rollout.replica` with a JSON launch config on
stdin (the authkey travels there, never in argv). On a machine without CUDA the engine runs in
vLLM's single-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0: ~2 s start-up, no extra processes);
on GPU vLLM runs as usual and `tensor_parallel_size` spans that many GPUs.

Protocol (`multiprocessing.connection` over TCP, bound to 127.0.0.1 unless told otherwise, always
with an authkey): each request is a dict `{"op": ...}`, each answer a dict with "ok"; a weight
bucket's bytes follow its request as one `send_bytes` message. Ops: health and version (both
answer the status dict), generate, nccl_init, update_begin, update_bucket, update_end, shutdown.
An update_bucket request names its transport: "socket" (its bytes follow), "shm" (its "source"
names a segment in /dev/shm, same host) or "nccl" (its "source" holds the layout; the bytes come
by NCCL broadcast, weights/nccl.py). Every
connection gets its own thread. Messages are pickles: the authkey is what keeps strangers out,
so treat it as a secret that grants code execution on the replica host.

Weight-update invariants (the engine lock is `ReplicaServer._cv`):
- A generation holds the engine lock from start to end: an update never interleaves with it.
- update_begin(version, stage, num_stages) waits for the running generation, then holds off new
  ones until every stage 0..num_stages-1 has sent update_end for that version.
- Buckets load in arrival order (worker_extension.py); when the last stage ends: coverage check
  -> prefix cache reset -> the version is published -> generation resumes.
- An update that fails (bad checksum, load error, a sender disconnecting mid-stage, a newer
  version starting, no progress within `update_timeout_s`) leaves the replica "incomplete": it
  refuses to generate (kind "stale") until a full update succeeds. It never serves mixed weights.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

EXTENSION = "megatron_async.rollout.worker_extension.WeightUpdateExtension"
STALL_TIMEOUT_S = 60.0  # server side: a peer that stops mid-message for this long is dropped


@dataclass
class ReplicaSpec:
    """How to build one replica's engine (the same for every replica of a pool)."""

    model: str  # HF checkpoint directory (config.json, safetensors, tokenizer)
    dtype: str = "float32"  # compare logprobs in fp32 (bf16 differs by up to ~0.7 nats)
    tensor_parallel_size: int = 1  # vLLM's own TP inside the replica (GPU)
    max_model_len: int = 1024
    kv_cache_bytes: int | None = 256 << 20  # required on CPU; None = gpu_memory_utilization
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    enforce_eager: bool = True
    initial_version: int = 0  # policy version of the checkpoint in `model`
    update_timeout_s: float = 300.0  # an update with no progress for this long is abandoned
    engine_kwargs: dict = field(default_factory=dict)  # any other `vllm.LLM` keyword


@dataclass
class Sampling:
    """Plain sampling fields, turned into vLLM `SamplingParams` inside the replica."""

    n: int = 1  # completions per prompt (K)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True  # return the sampled tokens' logprobs (vLLM logprobs=0)
    seed: int | None = None  # completion j of prompt i uses seed + i * n + j (pool)
    ignore_eos: bool = False  # fixed-length generation (benchmarks)


class ReplicaError(RuntimeError):
    """A replica answered a request with an error. `kind`: "stale", "update", "bad_request", "internal"."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


def _set_socket_timeouts(sock: socket.socket, seconds: float) -> None:
    # NOTE: SO_RCVTIMEO/SO_SNDTIMEO bound every blocking read/write, including those inside
    # multiprocessing's auth handshake and large send_bytes, which have no timeout of their own.
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class ReplicaClient:
    """Request/answer connection to one replica; every step is bounded by `timeout_s`.

    `timeout_s` bounds connecting, the handshake and any stall while sending or receiving;
    `call(..., wait_s=)` bounds the wait for the answer (default `timeout_s`). Failures raise
    `ConnectionError`/`TimeoutError` naming the replica; the connection is then closed.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout_s: float = 60.0, label: str | None = None):
        self.address = (address[0], int(address[1]))
        self.label = label or f"replica at {self.address[0]}:{self.address[1]}"
        self._authkey = authkey
        self.timeout_s = timeout_s
        self._conn: Connection | None = None
        self._aborted = False

    def _connect(self) -> Connection:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.settimeout(None)
            _set_socket_timeouts(sock, self.timeout_s)
            conn = Connection(sock.detach())
            answer_challenge(conn, self._authkey)
            deliver_challenge(conn, self._authkey)
        except OSError as e:  # refused, reset, or a handshake stalled past the socket timeout
            raise ConnectionError(f"{self.label}: cannot connect ({e!r})") from e
        except AuthenticationError as e:
            raise ConnectionError(f"{self.label}: authentication failed (wrong authkey?): {e}") from e
        return conn

    def call(self, op: str, payload: bytes | None = None, wait_s: float | None = None, **fields) -> dict:
        wait_s = self.timeout_s if wait_s is None else wait_s
        if self._aborted:
            self.close()
        try:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.send({"op": op, **fields})
            if payload is not None:
                self._conn.send_bytes(payload)
            if not self._conn.poll(wait_s):
                raise TimeoutError(f"{self.label}: no answer to {op!r} within {wait_s:.0f} s")
            answer = self._conn.recv()
        except TimeoutError:
            self.close()
            raise
        except BlockingIOError as e:  # a socket timeout: the peer stopped reading or writing
            self.close()
            raise TimeoutError(f"{self.label}: {op!r} stalled for more than {self.timeout_s:.0f} s") from e
        except (OSError, EOFError) as e:
            self.close()
            raise ConnectionError(f"{self.label}: connection lost during {op!r} ({e!r})") from e
        if not answer.get("ok"):
            raise ReplicaError(f"{self.label}: {op} failed: {answer.get('error')}", answer.get("kind", "internal"))
        return answer

    def close(self) -> None:
        self._aborted = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def abort(self) -> None:
        """From another thread: wake a call blocked on this connection (it fails); the next call reconnects."""
        conn = self._conn
        if conn is None:
            return
        self._aborted = True
        try:
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@dataclass
class _Update:
    version: int
    num_stages: int
    touched: float  # last progress (monotonic)
    open_stages: dict = field(default_factory=dict)  # stage -> buckets received
    done_stages: set = field(default_factory=set)


class ReplicaServer:
    """Serves one `LLM`. See the module docstring for the protocol and its invariants."""

    def __init__(self, llm, spec: ReplicaSpec, replica_id: int):
        self.llm, self.spec, self.replica_id = llm, spec, replica_id
        self.version = spec.initial_version
        self.weights_ok = True  # False after a failed update until a full update succeeds
        self.stale_reason = ""
        self._update: _Update | None = None
        self._cv = threading.Condition()  # the engine lock
        self.stopping = threading.Event()

    # -- connection handling ------------------------------------------------------------------
    def serve_connection(self, conn: Connection, authkey: bytes) -> None:
        """Authenticate, then answer requests until the peer leaves or the replica stops."""
        open_stage = None  # (version, stage) begun on this connection and not yet ended
        try:
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                _set_socket_timeouts(sock, STALL_TIMEOUT_S)  # applies to conn's socket too
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
            while not self.stopping.is_set():
                if not conn.poll(0.5):
                    continue
                req = conn.recv()
                op = req.get("op")
                payload = conn.recv_bytes() if op == "update_bucket" and req.get("transport") == "socket" else None
                try:
                    answer = self._dispatch(req, payload)
                except ReplicaError as e:
                    answer = {"ok": False, "error": str(e), "kind": e.kind}
                except Exception as e:  # noqa: BLE001 - reported to the caller, replica keeps serving
                    answer = {"ok": False, "error": f"{e!r}\n{traceback.format_exc()}", "kind": "internal"}
                if op == "update_begin" and answer["ok"]:
                    open_stage = (req["version"], req["stage"])
                elif op == "update_end":
                    open_stage = None
                conn.send(answer)
                if op == "shutdown":
                    self.stopping.set()
        except (EOFError, OSError, AuthenticationError) as e:
            if isinstance(e, AuthenticationError):
                print(f"[replica {self.replica_id}] rejected a connection: {e}", flush=True)
        finally:
            conn.close()
            if open_stage is not None:
                self._abort_if(open_stage[0], f"sender of stage {open_stage[1]} disconnected mid-update")

    def _dispatch(self, req: dict, payload: bytes | None) -> dict:
        op = req.get("op")
        if op in ("health", "version"):
            return {"ok": True, **self.status()}
        if op == "generate":
            return self._generate(req["prompts"], [Sampling(**s) for s in req["sampling"]], req.get("hold_s", 60.0))
        if op == "update_begin":
            return self._update_begin(req["version"], req["stage"], req["num_stages"])
        if op == "update_bucket":
            if req.get("transport") not in ("socket", "shm", "nccl"):
                raise ReplicaError(f"update_bucket: unknown transport {req.get('transport')!r}", "bad_request")
            source = payload if req["transport"] == "socket" else req["source"]
            return self._update_bucket(req["version"], req["stage"], source, req["checksum"])
        if op == "nccl_init":
            return self._nccl_init(req["stage"], req["address"], req["port"], req["rank_offset"], req["world_size"])
        if op == "update_end":
            return self._update_end(req["version"], req["stage"], req["num_buckets"])
        if op == "shutdown":
            return {"ok": True}
        raise ReplicaError(f"unknown op {op!r}", "bad_request")

    def status(self) -> dict:
        upd = self._update
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "version": self.version,
            "weights_ok": self.weights_ok,
            "stale_reason": self.stale_reason,
            "updating": None if upd is None else upd.version,
            "workers": self.spec.tensor_parallel_size,  # NCCL ranks this replica takes in a sync group
        }

    # -- generation ---------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], sampling: list[Sampling], hold_s: float) -> dict:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
                logprobs=0 if s.logprobs else None, seed=s.seed, ignore_eos=s.ignore_eos,
            )
            for s in sampling
        ]
        deadline = time.monotonic() + hold_s
        with self._cv:
            while self._update is not None:  # hold off while an update is in flight
                if time.monotonic() - self._update.touched > self.spec.update_timeout_s:
                    self._abort(f"update {self._update.version} made no progress for {self.spec.update_timeout_s:.0f} s")
                    break
                if time.monotonic() > deadline:
                    raise ReplicaError(f"weight update {self._update.version} still in progress after {hold_s:.0f} s", "stale")
                self._cv.wait(0.2)
            if not self.weights_ok:
                raise ReplicaError(f"weights incomplete since a failed update ({self.stale_reason}); needs a full update", "stale")
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            version = self.version
        results = []
        for out in outs:
            comps = []
            for c in out.outputs:
                lps = None if c.logprobs is None else [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                comps.append({"token_ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason})
            results.append(comps)
        return {"ok": True, "version": version, "outputs": results}

    # -- weight updates -----------------------------------------------------------------------
    def _abort(self, reason: str) -> None:
        """Mark the in-flight update failed (caller holds the lock)."""
        self._update = None
        self.weights_ok = False
        self.stale_reason = reason
        self._cv.notify_all()

    def _abort_if(self, version: int, reason: str) -> None:
        with self._cv:
            if self._update is not None and self._update.version == version:
                self._abort(reason)

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    def _update_begin(self, version: int, stage: int, num_stages: int) -> dict:
        if not 0 <= stage < num_stages:
            raise ReplicaError(f"stage {stage} out of range for {num_stages} stages", "bad_request")
        with self._cv:  # waits for a running generation to finish
            upd = self._update
            if upd is not None and (upd.version != version or upd.num_stages != num_stages):
                self._abort(f"update {upd.version} superseded by update {version} before it completed")
                upd = None
            if upd is None:
                if version < self.version:
                    raise ReplicaError(f"update {version} is older than the loaded version {self.version}", "update")
                self._rpc("mas_begin_update", version)
                upd = self._update = _Update(version, num_stages, time.monotonic())
            if stage in upd.open_stages or stage in upd.done_stages:
                raise ReplicaError(f"update {version}: stage {stage} already sent", "update")
            upd.open_stages[stage] = 0
            upd.touched = time.monotonic()
        return {"ok": True}

    def _current(self, version: int, stage: int) -> _Update:
        upd = self._update
        if upd is None or upd.version != version or stage not in upd.open_stages:
            reason = f" (update failed: {self.stale_reason})" if not self.weights_ok else ""
            raise ReplicaError(f"no open update {version} for stage {stage}{reason}", "update")
        return upd

    def _nccl_init(self, stage: int, address: str, port: int, rank_offset: int, world_size: int) -> dict:
        """Join stage `stage`'s NCCL weight-sync group (weights/nccl.py); blocks until the sender joins."""
        with self._cv:
            self._rpc("mas_nccl_init", stage, address, port, rank_offset, world_size)
        return {"ok": True}

    def _update_bucket(self, version: int, stage: int, source, expected_checksum: int) -> dict:
        """Load one bucket; `source` is its bytes or where to find them (worker_extension.mas_load_bucket)."""
        with self._cv:
            upd = self._current(version, stage)
            try:
                loaded = self._rpc("mas_load_bucket", source, expected_checksum)
            except Exception as e:
                self._abort(f"update {version} stage {stage} bucket {upd.open_stages[stage]}: {e}")
                raise ReplicaError(f"update {version} stage {stage} bucket {upd.open_stages[stage]} rejected: {e}", "update") from e
            upd.open_stages[stage] += 1
            upd.touched = time.monotonic()
        return {"ok": True, **loaded}

    def _update_end(self, version: int, stage: int, num_buckets: int) -> dict:
        with self._cv:
            upd = self._current(version, stage)
            if upd.open_stages[stage] != num_buckets:
                self._abort(f"update {version} stage {stage}: got {upd.open_stages[stage]} of {num_buckets} buckets")
                raise ReplicaError(self.stale_reason, "update")
            del upd.open_stages[stage]
            upd.done_stages.add(stage)
            upd.touched = time.monotonic()
            if len(upd.done_stages) < upd.num_stages:
                return {"ok": True, "complete": False, "version": self.version}
            try:
                info = self._rpc("mas_finish_update")
            except Exception as e:
                self._abort(str(e))
                raise ReplicaError(f"update {version} incomplete: {e}", "update") from e
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            self.version, self.weights_ok, self.stale_reason, self._update = version, True, "", None
            self._cv.notify_all()
        return {"ok": True, "complete": True, "version": version, **info}


def build_llm(spec: ReplicaSpec):
    """The vLLM engine for a spec (call after the environment is set; imports vllm)."""
    from vllm import LLM

    kwargs = dict(
        model=spec.model, dtype=spec.dtype, tensor_parallel_size=spec.tensor_parallel_size,
        max_model_len=spec.max_model_len, seed=spec.seed, enforce_eager=spec.enforce_eager,
        worker_extension_cls=EXTENSION, **spec.engine_kwargs,
    )
    if spec.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = spec.kv_cache_bytes
    else:
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    return LLM(**kwargs)


def _watch_parent(parent_pid: int) -> None:
    # NOTE: if the pool's process dies without stopping us (SIGKILL), exit instead of orphaning.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def main() -> None:
    """Entry point: read the launch config from stdin, build the engine, serve until shutdown."""
    from megatron_async.cluster.cpu_affinity import pin_replica_from_env

    pin_replica_from_env()  # rollout.replica_cpus: before any thread starts (threads inherit it)
    launch = json.loads(sys.stdin.read())
    threading.Thread(target=_watch_parent, args=(launch["parent_pid"],), daemon=True).start()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = ReplicaSpec(**launch["spec"])
    server = ReplicaServer(build_llm(spec), spec, launch["replica_id"])
    authkey = bytes.fromhex(launch["authkey"])
    if not authkey:
        raise SystemExit("replica: an authkey is required")
    # NOTE: the handshake runs in each connection's thread (serve_connection), not in accept(),
    # so a peer that stalls mid-handshake cannot block other connections.
    listener = Listener((launch["host"], launch["port"]), family="AF_INET")
    port = listener.address[1]
    tmp = launch["ready_file"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"port": port, "pid": os.getpid()}, f)
    os.replace(tmp, launch["ready_file"])
    print(f"[replica {launch['replica_id']}] serving on {launch['host']}:{port}", flush=True)

    def accept_loop():
        while True:
            conn = listener.accept()
            threading.Thread(target=server.serve_connection, args=(conn, authkey), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    server.stopping.wait()
    time.sleep(0.2)  # let the shutdown answer leave
    listener.close()
    print(f"[replica {launch['replica_id']}] shut down", flush=True)
    sys.stdout.flush()
    os._exit(0)


def launch_config(spec: ReplicaSpec, replica_id: int, host: str, port: int, authkey: bytes, ready_file: str) -> str:
    """The JSON `main` reads from stdin."""
    return json.dumps({
        "spec": asdict(spec), "replica_id": replica_id, "host": host, "port": port,
        "authkey": authkey.hex(), "ready_file": ready_file, "parent_pid": os.getpid(),
    })


if __name__ == "__main__":
    main()
