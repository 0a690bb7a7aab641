"""The run's weight update from its config: which sender each pipeline stage gets, and delta sync.

    weights = build_weight_update(cfg, layout, ctrl, pool, urls, key)   # once per run, every learner rank

Run once, before the first push (a push itself never comes here: weights/update.py drives the
sender through its interface). The choices:
- the sender (`rollout.weight_transport`, where auto is nccl for GPU replicas and host memory
  otherwise: config.weight_transport): on the sender rank of each pipeline stage (its TP rank 0
  of DP rank 0) a `BroadcastSender` (nccl / gloo: one group per stage and replica node,
  weights/broadcast.py) or a `HostMemorySender` (shm / http, weights/host_memory.py); the
  replicas' engine was started for the same choice;
- delta sync (`rollout.sync_full_every`, `resolve_full_every`): a full push every `full_every`,
  deltas in between (weights/delta.py), or every push full;
- the dtype the tensors are sent in: the replicas' (config.replica_dtype).
"""
from __future__ import annotations

import logging
from typing import Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_async.config import BROADCAST_TRANSPORTS, Config, replica_dtype, sync_bucket_bytes, weight_transport
from megatron_async.learner.parallel import ParallelLayout
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.weights.broadcast import BroadcastSender, make_wire
from megatron_async.weights.delta import DeltaSchedule
from megatron_async.weights.host_memory import HostMemorySender, carrier_for
from megatron_async.weights.update import WeightSender, WeightUpdate

log = logging.getLogger(__name__)

AUTO_FULL_EVERY = 10  # rollout.sync_full_every: auto, where deltas pay


def build_weight_update(cfg: Config, layout: ParallelLayout, ctrl: dist.ProcessGroup, pool: ReplicaPool | None,
                        urls: list[str], key: str) -> WeightUpdate:
    """This rank's part of the run's weight update: `pool` on rank 0 (None elsewhere), a sender on
    each stage's sender rank."""
    r = cfg.rollout
    send_dtype = getattr(torch, replica_dtype(cfg.model)[0])
    sender: WeightSender | None = None
    full_every = 0
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        transport, chosen = weight_transport(cfg)  # the replicas' engine was started for the same choice
        full_every, why = resolve_full_every(r.sync_full_every, transport, urls, send_dtype)
        log.info("weight sync, stage %d: %s (%s), %s (%s)", layout.pp_rank, transport, chosen,
                 f"deltas, a full sync every {full_every}" if full_every else "every sync full", why)
        if full_every and transport == "nccl":
            raise ValueError("delta sync over nccl is not built (vLLM's sparse_nccl backend is the path)")
        if transport in BROADCAST_TRANSPORTS:  # one group per (stage, replica node)
            sender = BroadcastSender(urls, key, wire=make_wire(transport), replica_tp=r.replica_tp,
                                     timeout_s=r.sync_timeout_s,
                                     bucket_bytes=sync_bucket_bytes(r.sync_bucket_mb, transport),
                                     address=r.rendezvous_address, base_port=r.rendezvous_port,
                                     stage=layout.pp_rank)
        else:
            sender = HostMemorySender(urls, key, timeout_s=r.sync_timeout_s, transport=transport,
                                      bucket_bytes=sync_bucket_bytes(r.sync_bucket_mb, transport))
    return WeightUpdate(ctrl, urls, r.weight_update, r.sync_timeout_s, layout.pp_rank, pool, sender,
                        send_dtype=send_dtype, schedule=DeltaSchedule(full_every) if full_every else None,
                        stage_turns=stage_turns(cfg, layout, urls))


def stage_turns(cfg: Config, layout: ParallelLayout, urls: Sequence[str]) -> int:
    """`WeightUpdate.stage_turns`: the pipeline stages stream in turn where a broadcast group spans
    several replicas (a node's, weights/broadcast.py), else at once. Why: each stage's group spans
    the node's replicas, a replica's engine serves one `/update_weights` at a time, in the order the
    stages' calls reach it, and every member of a group must be inside that stage's call for its
    broadcasts to complete; two replicas that took the stages' calls in opposite orders would each
    wait for the other (the deadlock slime PR #2331 met forming PP groups). In turn, every replica
    serves the stages in one order; the cost is the overlap of one stage's first gathers with the
    stage before it (a replica loads one stage after the other either way)."""
    transport, _ = weight_transport(cfg)
    hosts = [urlparse(u).hostname for u in urls]
    shared = len(set(hosts)) < len(hosts)
    return layout.pp if transport in BROADCAST_TRANSPORTS and shared and layout.pp > 1 else 1


def resolve_full_every(setting: int | str, transport: str, urls: Sequence[str], dtype: torch.dtype) -> tuple[int, str]:
    """`rollout.sync_full_every` -> (the update's `full_every`, why). auto: deltas (weights/delta.py)
    only where the bytes are what a sync costs, a replica reached over http, and for a 2-byte
    replica dtype (an fp32 Adam step changes most elements: its deltas go whole). Over shm and
    gloo the replica's loading, not the bytes, sets the time, so a delta's encoding is a loss, and
    nccl has no delta path (measured and explained in docs/replicas-and-weight-sync.md)."""
    if setting != "auto":
        return int(setting), "rollout.sync_full_every"
    if transport in BROADCAST_TRANSPORTS:
        return 0, f"auto: over {transport} a sync's time is the replica's loading, not the bytes"
    http = [u for u in urls if carrier_for(transport, u) == "http"]
    if http and dtype.itemsize == 2:
        return AUTO_FULL_EVERY, f"auto: {dtype} replicas reached over http ({len(http)} of {len(urls)})"
    return 0, f"auto: {'no replica is reached over http' if not http else f'{dtype} changes most elements per step'}"
