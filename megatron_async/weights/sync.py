"""Weight sync over the replicas' sockets (CPU transport): learner stage -> every vLLM replica.

Used on the source rank (TP rank 0) of every pipeline stage:

    sender = WeightSender(pool.addresses, pool.authkey, timeout_s=cfg.sync_timeout_s,
                          bucket_bytes=cfg.sync_bucket_mb << 20)
    metrics = sender.push(version, stage=pp_rank, num_stages=pp_size,
                          named_tensors=iter_hf_weights(model_chunks, hf_config))

Ordering, per replica and version (the replica enforces the rest, see rollout/replica.py):
update_begin (the replica finishes its running generation and holds off new ones) -> buckets in
stream order, each CRC32-checked before it is loaded -> update_end. When the last of the
`num_stages` stages ends, the replica checks that every parameter was covered, resets its prefix
cache and publishes `version`; only then does generation resume.

Memory: `named_tensors` is consumed lazily (buckets.iter_buckets); the sender holds one bucket's
tensors and its serialised bytes at a time, which it sends to all replicas concurrently before
pulling more tensors.

Failure: every request is bounded by `timeout_s` (connect, stall, answer). With `strict=True`
(default) a failing replica makes `push` raise `WeightSyncError` naming the replica, version and
stage, after closing its connections so that every replica it touched marks this update failed
(and refuses to generate until a full update arrives); with `strict=False` it is dropped from this push and reported in `metrics["failed"]` (a
pool restarting that replica lists it in `replicas_needing_weights()`). Either way the sender
first drains `named_tensors`: the other ranks of the stage take part in the gathers behind that
iterator, and stopping early would leave them blocked in a collective.

Not here: an NCCL transport. vLLM's weight-transfer engines are GPU-only and could not be
exercised on this CPU machine, so none is shipped rather than an untested one.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import torch

from megatron_async.rollout.replica import ReplicaClient, ReplicaError
from megatron_async.weights.buckets import iter_buckets


class WeightSyncError(RuntimeError):
    """A weight sync to a replica failed or timed out."""


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
    ):
        if not replica_addresses:
            raise ValueError("WeightSender needs at least one replica address")
        key = authkey.encode() if isinstance(authkey, str) else authkey
        if not key:
            raise ValueError("WeightSender needs the replicas' authkey")
        self.bucket_bytes, self.strict, self.timeout_s = bucket_bytes, strict, timeout_s
        self._clients = [
            ReplicaClient(tuple(a), key, timeout_s=timeout_s, label=f"replica at {a[0]}:{a[1]}") for a in replica_addresses
        ]
        self._pool = ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="weight-sync")

    def push(
        self, version: int, stage: int, num_stages: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict:
        """Send this stage's tensors as weight version `version`; returns metrics.

        Metrics: bytes (one copy of this stage's payload), bytes_total (all replicas), seconds
        (wall, including producing the tensors), send_seconds, gb_per_s (bytes_total / seconds),
        buckets, replicas (reached), completed (replicas that published `version` on this call,
        i.e. this stage ended last), failed ({replica: error}).
        """
        t0 = time.perf_counter()
        live = list(self._clients)
        failed: dict[str, str] = {}
        send_s = 0.0
        tensors = iter(named_tensors)

        def each(op: str, payload: bytes | None = None, **fields) -> list[dict]:
            nonlocal send_s
            t = time.perf_counter()
            futures = [(c, self._pool.submit(c.call, op, payload, **fields)) for c in live]
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
                for c in live:  # NOTE: a replica whose sender disconnects mid-update marks itself
                    c.close()  # incomplete at once, instead of holding generation until it times out
                for _ in tensors:  # drain: the stage's other ranks are in the gathers behind it
                    pass
                raise WeightSyncError(
                    f"weight sync of version {version} (stage {stage} of {num_stages}) failed during {op}: "
                    + "; ".join(failed.values())  # each message starts with its replica's label
                )
            return answers

        each("update_begin", version=version, stage=stage, num_stages=num_stages)
        num_buckets = nbytes = 0
        for bucket in iter_buckets(tensors, self.bucket_bytes):
            each("update_bucket", bucket.payload, version=version, stage=stage, checksum=bucket.checksum)
            num_buckets += 1
            nbytes += len(bucket.payload)
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
        }

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
