"""GPU replicas: weight buckets over vLLM's own `nccl` weight-transfer backend.

    sender = NcclSender(pool.urls, pool.key, address="127.0.0.1", replica_tp=1, timeout_s=120, bucket_bytes=...)
    metrics = sender.push(iter_hf_weights(...), urls=opened)      # between begin_update and finish_update

A replica started with `--weight-transfer-config '{"backend": "nccl"}'` (rollout.weight_transport:
nccl) builds vLLM's dense NCCL engine (vllm/distributed/weight_transfer/nccl_engine.py) in each of
its workers. Per replica there is one NCCL group: this sender is rank 0, the replica's TP workers
ranks 1..tp (vLLM's `rank_offset` 1). We drive it as vLLM's trainer-side engine
(`NCCLTrainerWeightTransferEngine`) does, with two differences that keep the pool's phases
(`ReplicaPool.begin_update` / `finish_update`: pause, start, finish with `weight_version`,
resume, the same as for the host-memory carriers of weights/sync.py):
- one `/update_weights` per bucket (its names, dtypes, shapes), sent while the bucket's tensors
  are broadcast one by one (vLLM's unpacked mode); the worker loads each through layerwise
  reload as it arrives, and the sender holds one bucket at a time;
- the groups persist: formed at a replica's first push (`/init_weight_transfer_engine` while
  this process opens its end, a TCPStore rendezvous at `address:port`), formed again only for a
  replica whose push failed or that restarted (`forget`).

Limits, by design of vLLM's engine: one trainer sender per replica group, so the learner runs
PP=1 with this transport (config.validate refuses PP>1; the TP gather happens before the sender).
NCCL has no per-call timeout here: a replica that dies inside a broadcast can hold the sender's
stream until the learner's NCCL watchdog fires, not only `timeout_s`.

Status: written against vLLM 0.32's API; not run (no machine of this project has vLLM on a GPU:
the lent GPU's image lacks vLLM and its wheel does not fit the 64 MiB carry). The host-memory
carriers (rollout.weight_transport: auto) work on GPU replicas too and are what runs by default.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

import torch

from megatron_async.rollout.launcher import free_port
from megatron_async.rollout.replica import ReplicaClient, ReplicaError
from megatron_async.weights.buckets import group_by_cap


def update_info(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """vLLM's `NCCLWeightTransferUpdateInfo` of one bucket, as the JSON `/update_weights` takes."""
    return {"names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


class NcclSender:
    """The learner's sender rank's NCCL groups with GPU replicas, and the bucket stream over them."""

    def __init__(self, urls: Sequence[str], key: str, *, address: str, replica_tp: int, timeout_s: float,
                 bucket_bytes: int, base_port: int = 0):
        self.address, self.world_size = address, 1 + replica_tp
        self.timeout_s, self.bucket_bytes, self.base_port = timeout_s, bucket_bytes, base_port
        self._index = {u: i for i, u in enumerate(urls)}
        self._clients = {u: ReplicaClient(u, key, timeout_s=timeout_s, label=f"replica {i}") for i, u in enumerate(urls)}
        self._groups: dict = {}  # url -> vLLM PyNcclCommunicator, formed by `_connect`
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="nccl-sync")

    def forget(self, urls: Iterable[str]) -> None:
        """Drop the groups of replicas that restarted or failed a push: formed again at their next push."""
        for url in urls:
            if (group := self._groups.pop(url, None)) is not None:
                group.destroy()

    def _connect(self, url: str) -> None:
        # NOTE: imported here, not at the top: only the sender rank of a run with GPU replicas needs
        # vLLM, and importing it costs seconds (and CUDA probing) on every learner rank
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo, trainer_init, worker_init_payload)

        port = self.base_port + self._index[url] if self.base_port else free_port(self.address)
        info = NCCLWeightTransferInitInfo(master_address=self.address, master_port=port, rank_offset=1,
                                          world_size=self.world_size, packed=False)
        # the replica's workers block in init until this end joins: both must rendezvous together
        joined = self._pool.submit(self._clients[url].init_weight_transfer, worker_init_payload(info))
        self._groups[url] = trainer_init(info)
        joined.result(timeout=self.timeout_s)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], urls: Sequence[str] | None = None) -> dict:
        """Stream the tensors into the open update of each replica in `urls` (None: all); the
        metrics of weights/sync.WeightSender.push (carriers ["nccl"])."""
        t0 = time.perf_counter()
        urls = list(self._clients) if urls is None else urls
        failed: dict[str, str] = {}
        live = []
        for url in urls:
            try:
                if url not in self._groups:
                    self._connect(url)
                live.append(url)
            except Exception as e:  # noqa: BLE001 - reported; the replica is left out of this push
                failed[url] = f"forming its NCCL group: {e!r}"
                self.forget([url])
        num_buckets = nbytes = 0
        stream = torch.cuda.current_stream()
        for bucket in group_by_cap(named_tensors, self.bucket_bytes):  # drained even with no replica left
            if not live:
                continue
            info = update_info(bucket)
            receiving = {u: self._pool.submit(self._clients[u].update_weights, info) for u in live}
            for url in live:
                for _, tensor in bucket:
                    self._groups[url].broadcast(tensor.contiguous(), src=0, stream=stream)
            stream.synchronize()
            for url, fut in receiving.items():
                try:
                    fut.result(timeout=self.timeout_s)
                except (ConnectionError, TimeoutError, ReplicaError) as e:
                    failed[url] = str(e)
                    live.remove(url)
                    self.forget([url])
            num_buckets += 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        seconds = time.perf_counter() - t0
        return {"bytes": nbytes, "bytes_total": nbytes * len(live), "seconds": seconds, "send_seconds": seconds,
                "gb_per_s": nbytes * len(live) / seconds / 1e9 if seconds > 0 else 0.0, "buckets": num_buckets,
                "replicas": len(live), "failed": failed, "carriers": ["nccl"]}

    def close(self) -> None:
        self.forget(list(self._groups))
        for client in self._clients.values():
            client.close()
        self._pool.shutdown(wait=False)
