"""The run's weight update from its config: which sender each pipeline stage gets, and delta sync.

    weights = build_weight_update(cfg, plan, layout, ctrl, pool, urls, key)   # once per run, every learner rank

Run once, before the first push (a push itself never comes here: weights/update.py drives the
sender through its interface). The choices:
- the sender (`rollout.weight_transport`, where auto is nccl for GPU replicas and host memory
  otherwise: the run plan's, run_plan.py): on the sender rank of each pipeline stage (its TP rank 0
  of DP rank 0) a `BroadcastSender` (nccl / gloo: one group per stage and replica node,
  weights/broadcast.py) or a `HostMemorySender` (shm / http, weights/host_memory.py); the
  replicas' engine was started for the same choice;
- delta sync (`rollout.sync_full_every`, the plan's `sync_full_every`): a full push every
  `full_every`, deltas in between (weights/delta.py), or every push full;
- the dtype the tensors are sent in: the replicas' (the plan's `model_dtype`).
"""
from __future__ import annotations

import logging
from typing import Sequence
from urllib.parse import urlparse

import torch.distributed as dist

from megatron_async.config import Config
from megatron_async.learner.parallel import ParallelLayout
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.run_plan import RunPlan
from megatron_async.transports import TRANSPORTS
from megatron_async.weights.broadcast import BroadcastSender, make_wire
from megatron_async.weights.delta import DeltaSchedule
from megatron_async.weights.host_memory import HostMemorySender
from megatron_async.weights.update import WeightSender, WeightUpdate

log = logging.getLogger(__name__)


def build_weight_update(cfg: Config, plan: RunPlan, layout: ParallelLayout, ctrl: dist.ProcessGroup, pool: ReplicaPool | None,
                        urls: list[str], key: str) -> WeightUpdate:
    """This rank's part of the run's weight update: `pool` on rank 0 (None elsewhere), a sender on
    each stage's sender rank."""
    r, transport, full_every = cfg.rollout, plan.weight_transport, plan.sync_full_every
    sender: WeightSender | None = None
    if layout.tp_rank == 0 and layout.dp_rank == 0:  # the replicas' engine was started for the same plan
        log.info("weight sync, stage %d: %s, %s", layout.pp_rank, transport,
                 f"deltas, a full sync every {full_every}" if full_every else "every sync full")
        if TRANSPORTS[transport].broadcast:  # one group per (stage, replica node)
            sender = BroadcastSender(urls, key, wire=make_wire(transport), replica_tp=r.replica_tp,
                                     timeout_s=r.sync_timeout_s, bucket_bytes=plan.sync_bucket_bytes,
                                     address=r.rendezvous_address, base_port=r.rendezvous_port,
                                     stage=layout.pp_rank)
        else:
            sender = HostMemorySender(urls, key, timeout_s=r.sync_timeout_s, transport=transport,
                                      bucket_bytes=plan.sync_bucket_bytes)
    return WeightUpdate(ctrl, urls, r.weight_update, r.sync_timeout_s, layout.pp_rank, pool, sender,
                        send_dtype=plan.torch_dtype, schedule=DeltaSchedule(full_every) if full_every else None,
                        stage_turns=stage_turns(plan, layout, urls))


def stage_turns(plan: RunPlan, layout: ParallelLayout, urls: Sequence[str]) -> int:
    """`WeightUpdate.stage_turns`: the pipeline stages stream in turn where a broadcast group spans
    several replicas (a node's, weights/broadcast.py), else at once. Why: each stage's group spans
    the node's replicas, a replica's engine serves one `/update_weights` at a time, in the order the
    stages' calls reach it, and every member of a group must be inside that stage's call for its
    broadcasts to complete; two replicas that took the stages' calls in opposite orders would each
    wait for the other (the deadlock slime PR #2331 met forming PP groups). In turn, every replica
    serves the stages in one order; the cost is the overlap of one stage's first gathers with the
    stage before it (a replica loads one stage after the other either way)."""
    hosts = [urlparse(u).hostname for u in urls]
    shared = len(set(hosts)) < len(hosts)
    return layout.pp if TRANSPORTS[plan.weight_transport].broadcast and shared and layout.pp > 1 else 1

