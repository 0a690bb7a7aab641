"""Weight sync: learner stage -> every vLLM replica, over a chosen transport.

Used on the source rank (TP rank 0) of every pipeline stage:

    sender = WeightSender(pool.addresses, pool.authkey, timeout_s=cfg.sync_timeout_s,
                          bucket_bytes=cfg.sync_bucket_mb << 20, transport=cfg.weight_transport)
    metrics = sender.push(version, stage=pp_rank, num_stages=pp_size,
                          named_tensors=iter_hf_weights(model_chunks, hf_config))

Bucketing and naming are the same for every transport (buckets.group_by_cap over HF names);
the transport is only how a bucket's bytes reach the replica (`rollout.weight_transport`):
- socket: the bytes follow the request on the control socket (any host).
- shm: the sender packs each bucket into one of two reused /dev/shm segments (weights/shm.py) and
  sends only its path, size and CRC32; replicas on this host read it zero-copy. `auto` picks shm for a
  replica addressed by loopback (unless /dev/shm cannot hold two buckets), socket for any other.
- nccl: GPU replicas; one NCCL broadcast per bucket from this stage's GPU (weights/nccl.py), the
  layout and checksum on the control socket. Not yet run (no GPU so far); chosen only explicitly.

Ordering, per replica and version (the replica enforces the rest, see rollout/replica.py):
update_begin (the replica finishes its running generation and holds off new ones) -> buckets in
stream order, each checksummed before it is loaded -> update_end. When the last of the
`num_stages` stages ends, the replica checks that every parameter was covered, resets its prefix
cache and publishes `version`; only then does generation resume.

Pipelining and memory: `named_tensors` is consumed lazily. One bucket is in flight: while the
replicas load bucket k, the sender pulls and packs bucket k+1 (into the other shm segment); it
sends k+1 once every replica has answered k. So the sender holds at most two buckets' bytes.

Failure: every request is bounded by `timeout_s` (connect, stall, answer). With `strict=True`
(default) a failing replica makes `push` raise `WeightSyncError` naming the replica, version and
stage, after closing its connections so that every replica it touched marks this update failed
(and refuses to generate until a full update arrives); with `strict=False` it is dropped from this push and reported in `metrics["failed"]` (a
pool restarting that replica lists it in `replicas_needing_weights()`). Over NCCL any failure
raises (the group is torn down; the next push forms a new one). Either way the sender first
drains `named_tensors`: the other ranks of the stage take part in the gathers behind that
iterator, and stopping early would leave them blocked in a collective.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, get_args

import torch

from megatron_async.config import LOOPBACK_HOSTS, WeightTransport
from megatron_async.rollout.replica import ReplicaClient, ReplicaError
from megatron_async.weights import nccl
from megatron_async.weights.buckets import device_checksum, group_by_cap, iter_buckets
from megatron_async.weights.shm import HEADER_SLACK, ShmSegment
from megatron_async.weights.shm import free_bytes as shm_free_bytes

log = logging.getLogger(__name__)

class WeightSyncError(RuntimeError):
    """A weight sync to a replica failed or timed out."""


def transport_for(transport: str, host: str) -> str:
    """The transport used for one replica: `auto` is shm for a loopback address, else socket."""
    if transport not in get_args(WeightTransport):
        raise ValueError(f"rollout.weight_transport={transport!r}: expected one of {', '.join(get_args(WeightTransport))}")
    if transport == "auto":
        return "shm" if host in LOOPBACK_HOSTS else "socket"
    if transport == "shm" and host not in LOOPBACK_HOSTS:
        raise ValueError(f"rollout.weight_transport=shm needs replicas on this host; replica at {host} is not "
                         f"loopback (use auto or socket)")
    return transport


class WeightSender:
    """Pushes one pipeline stage's HF-named weights to every replica. Not thread-safe."""

    def __init__(
        self,
        replica_addresses: Sequence[tuple[str, int]],
        authkey: str | bytes,
        *,
        timeout_s: float = 120.0,
        bucket_bytes: int = 64 << 20,
        strict: bool = True,
        transport: str = "auto",
    ):
        if not replica_addresses:
            raise ValueError("WeightSender needs at least one replica address")
        key = authkey.encode() if isinstance(authkey, str) else authkey
        if not key:
            raise ValueError("WeightSender needs the replicas' authkey")
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._clients = [
            ReplicaClient(tuple(a), key, timeout_s=timeout_s, label=f"replica at {a[0]}:{a[1]}") for a in replica_addresses
        ]
        self._kind = {c: transport_for(transport, c.address[0]) for c in self._clients}
        need = 2 * (bucket_bytes + HEADER_SLACK)
        if transport == "auto" and "shm" in self._kind.values() and shm_free_bytes() < need:
            log.warning("weight sync: /dev/shm has less than the %d MiB two buckets need; auto uses the socket",
                        need >> 20)
            self._kind = {c: "socket" for c in self._clients}
        self.transports = sorted(set(self._kind.values()))
        self.strict = strict or "nccl" in self.transports  # an NCCL group cannot drop a member
        if "nccl" in self.transports and not torch.cuda.is_available():
            raise ValueError("rollout.weight_transport=nccl needs CUDA on the learner (use auto, shm or socket)")
        # two segments: one being read by the replicas while the next bucket is packed into the other
        self._segments = [ShmSegment(bucket_bytes), ShmSegment(bucket_bytes)] if "shm" in self.transports else []
        self._nccl = None  # (stage, communicator, side stream) once formed
        self._pool = ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="weight-sync")

    def push(
        self, version: int, stage: int, num_stages: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict:
        """Send this stage's tensors as weight version `version`; returns metrics.

        Metrics: bytes (one copy of this stage's payload), bytes_total (all replicas), seconds
        (wall, including producing the tensors), send_seconds (waiting for the replicas' answers),
        gb_per_s (bytes_total / seconds), buckets, replicas (reached), completed (replicas that
        published `version` on this call, i.e. this stage ended last), failed ({replica: error}),
        transports.
        """
        t0 = time.perf_counter()
        live = list(self._clients)
        failed: dict[str, str] = {}
        send_s = 0.0
        tensors = iter(named_tensors)

        def submit(op: str, by_kind: dict | None = None, during: Callable[[], None] | None = None, **fields) -> tuple:
            """`op` to every live replica at once; by_kind[transport] = (extra fields, payload bytes)."""
            futures = []
            for c in live:
                extra, payload = by_kind[self._kind[c]] if by_kind else ({}, None)
                futures.append((c, self._pool.submit(c.call, op, payload, **fields, **extra)))
            if during is not None:
                try:
                    during()  # NCCL: the broadcast the replicas are now waiting in
                except Exception as e:  # noqa: BLE001 - the replicas' answers then time out: reported together
                    failed["this sender"] = f"this sender: broadcast failed: {e!r}"
            return op, futures

        def collect(sent: tuple) -> list[dict]:
            nonlocal send_s
            op, futures = sent
            t = time.perf_counter()
            answers = []
            for client, fut in futures:
                try:
                    answers.append(fut.result())
                except (ConnectionError, TimeoutError, ReplicaError) as e:
                    failed[client.label] = str(e)
                    live.remove(client)
                    client.close()
            send_s += time.perf_counter() - t
            if failed and self.strict:
                self._close_nccl()  # a group with a missing member cannot broadcast again
                for c in live:  # NOTE: a replica whose sender disconnects mid-update marks itself
                    c.close()  # incomplete at once, instead of holding generation until it times out
                for _ in tensors:  # drain: the stage's other ranks are in the gathers behind it
                    pass
                raise WeightSyncError(
                    f"weight sync of version {version} (stage {stage} of {num_stages}, {'/'.join(self.transports)}) "
                    f"failed during {op}: " + "; ".join(failed.values())  # each message starts with its replica's label
                )
            return answers

        def each(op: str, **fields) -> list[dict]:
            return collect(submit(op, **fields))

        if "nccl" in self.transports and (self._nccl is None or self._nccl[0] != stage):
            try:
                self._open_nccl(stage, each)
            except WeightSyncError:
                for _ in tensors:  # drain, as above
                    pass
                raise
        each("update_begin", version=version, stage=stage, num_stages=num_stages)
        num_buckets = nbytes = 0
        in_flight = None
        # NOTE: one bucket in flight: the next bucket is packed (the generator's step) while the
        # replicas load this one; its answers are collected before the next is sent. Buffers
        # alternate (two shm segments), so a bucket being read is never overwritten.
        for by_kind, size, during in self._buckets(tensors, stage):
            if in_flight is not None:
                collect(in_flight)
            in_flight = submit("update_bucket", by_kind, during, version=version, stage=stage)
            num_buckets += 1
            nbytes += size
        if in_flight is not None:
            collect(in_flight)
        answers = each("update_end", version=version, stage=stage, num_buckets=num_buckets)
        seconds = time.perf_counter() - t0
        return {
            "bytes": nbytes,
            "bytes_total": nbytes * len(live),
            "seconds": seconds,
            "send_seconds": send_s,
            "gb_per_s": nbytes * len(live) / seconds / 1e9 if seconds > 0 else 0.0,
            "buckets": num_buckets,
            "replicas": len(live),
            "completed": sum(bool(a.get("complete")) for a in answers),
            "failed": failed,
            "transports": self.transports,
        }

    def _buckets(self, tensors: Iterable[tuple[str, torch.Tensor]], stage: int):
        """Per bucket: (by_kind request parts, payload bytes, action to run while replicas wait)."""
        if self._nccl is not None:
            for group in group_by_cap(tensors, self.bucket_bytes):
                buf, layout = nccl.pack(group, torch.device("cuda", torch.cuda.current_device()))
                source = {"nccl": stage, "layout": layout, "nbytes": buf.numel()}
                yield ({"nccl": ({"transport": "nccl", "source": source, "checksum": device_checksum(buf)}, None)},
                       buf.numel(), lambda buf=buf: self._broadcast(buf))
            return
        turn = {"count": 0, "segment": None}

        def alloc(nbytes: int):  # the segment the previous bucket did not use
            turn["segment"] = self._segments[turn["count"] % 2]
            turn["count"] += 1
            return turn["segment"].buffer(nbytes)

        for bucket in iter_buckets(tensors, self.bucket_bytes, alloc if self._segments else bytearray):
            size = len(bucket.payload)
            by_kind = {"socket": ({"transport": "socket", "checksum": bucket.checksum}, bucket.payload)}
            if self._segments:
                shm = {"shm": turn["segment"].path, "size": size}
                by_kind["shm"] = ({"transport": "shm", "source": shm, "checksum": bucket.checksum}, None)
            yield by_kind, size, None

    # -- NCCL -----------------------------------------------------------------------------------
    def _open_nccl(self, stage: int, each) -> None:
        """Form this stage's NCCL group with every replica worker (rank 0 = this process)."""
        self._close_nccl()
        workers = [a["workers"] for a in each("health")]
        host = self._clients[0].address[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the address replicas reach us by
            s.connect((host, 9))
            address = s.getsockname()[0]
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
        world = 1 + sum(workers)
        offsets = [1 + sum(workers[:i]) for i in range(len(workers))]
        result: dict = {}
        device = torch.cuda.current_device()  # per thread in CUDA: the joiner must set it again

        def join():  # NOTE: blocks until every worker joins; a daemon thread so a no-show cannot hang us
            try:
                torch.cuda.set_device(device)
                result["comm"] = nccl.open_sender_group(address, port, world)
            except Exception as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                result["error"] = e

        joiner = threading.Thread(target=join, daemon=True, name="weight-sync-nccl-init")
        joiner.start()
        futures = [self._pool.submit(c.call, "nccl_init", None, stage=stage, address=address, port=port,
                                     rank_offset=off, world_size=world) for c, off in zip(self._clients, offsets)]
        errors = []
        for fut in futures:
            try:
                fut.result()
            except (ConnectionError, TimeoutError, ReplicaError) as e:
                errors.append(str(e))
        joiner.join(self.timeout_s)
        if errors or "comm" not in result:
            if "comm" in result:
                result["comm"].destroy()
            why = errors or [repr(result.get("error", f"no rendezvous within {self.timeout_s:.0f} s"))]
            raise WeightSyncError(f"NCCL weight-sync group for stage {stage} at {address}:{port} failed: " + "; ".join(why))
        self._nccl = (stage, result["comm"], torch.cuda.Stream())

    def _broadcast(self, buf: torch.Tensor) -> None:
        # NOTE: on a side stream, so that a broadcast a replica never joins blocks only that stream,
        # not the learner's compute; record_stream keeps `buf` alive until the broadcast is done.
        _, comm, stream = self._nccl
        stream.wait_stream(torch.cuda.current_stream())
        comm.broadcast(buf, src=0, stream=stream)
        buf.record_stream(stream)

    def _close_nccl(self) -> None:
        if self._nccl is not None:
            self._nccl[1].destroy()
            self._nccl = None

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._close_nccl()
        for segment in self._segments:
            segment.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
