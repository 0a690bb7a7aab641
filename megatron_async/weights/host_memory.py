"""The host-memory weight sender: one learner pipeline stage -> every replica's `mas_cpu` engine.

A sync is one vLLM weight update (weight-transfer API: start / update* / finish; weights/update.py
runs the phases); in between, the sender rank of each pipeline stage (its TP rank 0, after the TP
gather and the one HF mapping) streams its own tensors (the interface: weights/sender.py):

    sender = HostMemorySender(pool.urls, pool.key, timeout_s=..., bucket_bytes=..., transport="auto")  # once per run
    result = sender.push(iter_hf_weights(...), urls=opened)      # each sync, into the replicas that opened it

Bucketing and naming are the same for every carrier (buckets.group_by_cap over HF names); the
carrier is how a bucket's bytes reach the replica's `mas_cpu` engine (weights/cpu_engine.py),
`rollout.weight_transport`:
- shm: packed into one of two reused /dev/shm segments (weights/shm.py); the request carries
  only its path, size and CRC32. `auto` picks it for a replica at a loopback address (unless
  /dev/shm cannot hold two buckets).
- http: the payload base64-encoded in the request's JSON body (replicas on other hosts).
Both work for GPU replicas too. `nccl` (vLLM's own NCCL backend, GPU to GPU) and `gloo` are the
other sender: weights/broadcast.py.

The sender lives as long as the run: its shared-memory segments are reserved once (64 MB each
by default: reserving them costs ~0.1 s), not per sync.

Pipelining and memory: `named_tensors` is consumed lazily with one bucket in flight: while the
replicas load bucket k, the sender packs bucket k+1 (into the other shm segment), and sends it
once every replica answered k. The sender holds at most two buckets' bytes.

Integrity: each bucket's CRC32 (weights/buckets.py) is verified by the replica before anything
from it loads. Over shm it is a sampled checksum once a replica has taken a full-checksum sync
from this sender; the first push to a replica, every push after one of its failures (or after
`forget`), and every http push check every byte. A full checksum costs a pass over the payload
on each side (a third of a SmolLM2 sync); the bytes of an shm bucket never leave this host's
memory, and the sample still catches a wrong, truncated or rewritten segment.

Delta sync (`rollout.sync_full_every`): weights/update.py decides and encodes it (weights/delta.py);
with `keep` every bucket asks the replica to keep what it loads, the base of the next delta.

Failure: every request is bounded by `timeout_s`. A replica that fails a bucket is dropped from
the rest of this push and reported in `PushResult.failed`; rank 0 does not publish the version
on it, so it stays out of dispatch until a later full push (the pool restarts it if it died).
The sender always drains `named_tensors`: the stage's other ranks take part in the gathers
behind that iterator, and stopping early would leave them blocked in a collective.
"""
from __future__ import annotations

import base64
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence, get_args
from urllib.parse import urlparse

import torch

from megatron_async.config import BROADCAST_TRANSPORTS, LOOPBACK_HOSTS, WeightTransport
from megatron_async.rollout.replica import ReplicaClient, ReplicaError
from megatron_async.weights.buckets import SAMPLE_STRIDE, iter_buckets
from megatron_async.weights.sender import PushResult
from megatron_async.weights.shm import HEADER_SLACK, ShmSegment
from megatron_async.weights.shm import free_bytes as shm_free_bytes

log = logging.getLogger(__name__)


def carrier_for(transport: str, url: str) -> str:
    """The carrier used for one replica: `auto` is shm for a loopback address, else http."""
    if transport not in get_args(WeightTransport):
        raise ValueError(f"rollout.weight_transport={transport!r}: expected one of {', '.join(get_args(WeightTransport))}")
    host = urlparse(url).hostname
    if transport == "auto":
        return "shm" if host in LOOPBACK_HOSTS else "http"
    if transport == "shm" and host not in LOOPBACK_HOSTS:
        raise ValueError(f"rollout.weight_transport=shm needs replicas on this host; replica at {url} is not "
                         f"loopback (use auto or http)")
    if transport in BROADCAST_TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={transport} is weights/broadcast.BroadcastSender's, not this sender's")
    return transport


class HostMemorySender:
    """Streams one pipeline stage's HF-named tensors into every replica's open weight update."""

    def __init__(self, urls: Sequence[str], key: str, *, timeout_s: float = 120.0, bucket_bytes: int = 64 << 20,
                 transport: str = "auto"):
        if not urls:
            raise ValueError("HostMemorySender needs at least one replica URL")
        if not key:
            raise ValueError("HostMemorySender needs the replicas' key")
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._clients = {u: ReplicaClient(u, key, timeout_s=timeout_s) for u in urls}
        self._carrier = {c: carrier_for(transport, c.url) for c in self._clients.values()}
        need = 2 * (bucket_bytes + HEADER_SLACK)
        if transport == "auto" and "shm" in self._carrier.values() and shm_free_bytes() < need:
            log.warning("weight sync: /dev/shm has less than the %d MiB two buckets need; auto uses http", need >> 20)
            self._carrier = {c: "http" for c in self._clients.values()}
        self.carriers = sorted(set(self._carrier.values()))
        # two segments: one being read by the replicas while the next bucket is packed into the other
        self._segments = [ShmSegment(bucket_bytes), ShmSegment(bucket_bytes)] if "shm" in self.carriers else []
        self._pool = ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="weight-sync")
        self._verified: set[str] = set()  # replicas whose last push from here had every byte checked, or a sample since

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], urls: Sequence[str] | None = None,
             keep: bool = False) -> PushResult:
        """Send this stage's tensors into the open update of the replicas at `urls` (None: all)."""
        t0 = time.perf_counter()
        live = list(self._clients.values()) if urls is None else [self._clients[u] for u in urls]
        failed: dict[str, str] = {}
        sampled = self.carriers == ["shm"] and all(c.url in self._verified for c in live)
        send_s = 0.0
        num_buckets = nbytes = 0
        in_flight: list = []

        def collect() -> None:
            nonlocal send_s
            t = time.perf_counter()
            for client, fut in in_flight:
                try:
                    fut.result()
                except (ConnectionError, TimeoutError, ReplicaError) as e:
                    failed[client.url] = str(e)
                    live.remove(client)
            in_flight.clear()
            send_s += time.perf_counter() - t

        for bucket_info, size in self._buckets(named_tensors, secrets.randbelow(SAMPLE_STRIDE) if sampled else None, keep):
            collect()  # NOTE: one bucket in flight; its shm segment is rewritten two buckets later
            in_flight.extend((c, self._pool.submit(c.update_weights, bucket_info[self._carrier[c]])) for c in live)
            num_buckets += 1
            nbytes += size
        collect()
        self._verified |= {c.url for c in live}
        self._verified -= failed.keys()
        return PushResult(bytes=nbytes, replicas=len(live), buckets=num_buckets, seconds=time.perf_counter() - t0,
                          send_seconds=send_s, failed=failed, carriers=self.carriers)

    def _buckets(self, tensors: Iterable[tuple[str, torch.Tensor]], sample_offset: int | None, keep: bool):
        """Per bucket: ({carrier: update_info}, payload bytes); `sample_offset`: sampled checksums."""
        turn: dict[str, Any] = {"count": 0, "segment": None}  # the buckets so far, the segment the last one used

        def alloc(nbytes: int):  # the segment the previous bucket did not use
            turn["segment"] = self._segments[turn["count"] % 2]
            turn["count"] += 1
            return turn["segment"].buffer(nbytes)

        for bucket in iter_buckets(tensors, self.bucket_bytes, alloc if self._segments else bytearray, sample_offset):
            size = len(bucket.payload)
            info = {}
            if "http" in self.carriers:
                info["http"] = {"data": base64.b64encode(bucket.payload).decode("ascii"), "checksum": bucket.checksum,
                                "keep": keep}
            if self._segments:
                info["shm"] = {"shm": turn["segment"].path, "size": size, "checksum": bucket.checksum,
                               "sample_offset": bucket.sample_offset, "keep": keep}
            yield info, size

    def forget(self, urls: Iterable[str]) -> None:
        """The next push to these replicas checks every byte (no connection or group is kept)."""
        self._verified -= set(urls)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        for segment in self._segments:
            segment.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "HostMemorySender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
