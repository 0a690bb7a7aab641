"""One weight update, end to end: `WeightUpdate.push`, called by every learner rank.

    weights = WeightUpdate.build(cfg, layout, ctrl, pool, urls, key)   # once per run
    result = weights.push(version, learner.hf_weights())             # each sync (or a re-sync of some replicas)

    weights = WeightUpdate.local(pool, sender)                                # one process: tests, tools, benchmarks

Phases (vLLM's weight-transfer API), and who runs them:
1. rank 0 opens the update on each target replica (`ReplicaPool.begin_update`: pause,
   `/start_weight_update`) and tells every rank which ones opened;
2. the sender rank of each pipeline stage (its TP rank 0 of DP rank 0) builds the stage's stream
   once, here: its HF tensors cast to the replicas' dtype (`model.dtype`; an fp32 learner sends
   bf16 replicas half the bytes), compared with what the last push sent by one exact, bit-based
   comparison (weights/delta.py's `DeltaEncoder`), which gives both the changed count and, on a
   push the `DeltaSchedule` allows, the deltas. A sender only carries that stream into the opened
   replicas (weights/sender.py's interface: the host-memory or the broadcast sender, chosen by
   `rollout.weight_transport`, where auto is nccl for GPU replicas: config.weight_transport); the
   stage's other ranks only take part in the TP gathers behind `named_tensors`;
3. every rank reports the replicas its stage could not reach, and its changed count; rank 0
   publishes the version on those every stage reached (`ReplicaPool.finish_update`: verify,
   `/finish_weight_update`, resume) and closes the update without a version on the others; its
   result carries the fraction changed over every stage (`weight_sync/changed_fraction`);
4. the verdict: a replica left out is not fresh (its pool restarts it if it died, and the loop
   re-syncs it before it takes work). The run stops (`WeightSyncError`, on every rank) only when
   an update reached no replica while some target is up and refusing it (retrying would loop), or
   when a replica is configured unlike the run (`push(check=False)` returns it in `stop` instead).

`local` is the same update in one process, rank 0 and the only stage's sender at once (no process
group), for tests, tools and benchmarks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_async.config import BROADCAST_TRANSPORTS, Config, replica_dtype, weight_transport
from megatron_async.learner.parallel import ParallelLayout, from_rank0
from megatron_async.rollout.pool import ReplicaPool, UpdateMode
from megatron_async.weights.broadcast import BroadcastSender, make_wire
from megatron_async.weights.delta import DeltaEncoder, DeltaSchedule
from megatron_async.weights.host_memory import HostMemorySender, carrier_for
from megatron_async.weights.sender import PushResult, WeightSender, WeightSyncError

log = logging.getLogger(__name__)

AUTO_FULL_EVERY = 10  # rollout.sync_full_every: auto, where deltas pay


def resolve_full_every(setting: int | str, transport: str, urls: Sequence[str], dtype: torch.dtype) -> tuple[int, str]:
    """`rollout.sync_full_every` -> (the sender's `full_every`, why). auto: deltas (weights/delta.py)
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


@dataclass
class WeightUpdate:
    ctrl: dist.ProcessGroup | None  # gloo group of every learner rank; None: one process (`local`)
    urls: list[str]  # the replicas, by id
    mode: UpdateMode  # rollout.weight_update
    timeout_s: float  # rollout.sync_timeout_s: opening the update (waiting for a running generate)
    stage: int  # this rank's pipeline stage
    pool: ReplicaPool | None = None  # rank 0 only
    sender: WeightSender | None = None  # the stage's sender rank only
    encoder: DeltaEncoder | None = None  # the stage's sender rank only: what the replicas hold
    send_dtype: torch.dtype = torch.float32  # the replicas' (config.replica_dtype): tensors are sent in it
    schedule: DeltaSchedule | None = None  # delta sync (rollout.sync_full_every), on the stage's sender rank

    def __post_init__(self) -> None:
        if self.sender is not None and self.encoder is None:
            self.encoder = DeltaEncoder(keep_whole=self.schedule is not None)

    @classmethod
    def build(cls, cfg: Config, layout: ParallelLayout, ctrl: dist.ProcessGroup, pool: ReplicaPool | None,
              urls: list[str], key: str) -> "WeightUpdate":
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
            if transport in BROADCAST_TRANSPORTS:  # one group per (stage, replica)
                sender = BroadcastSender(urls, key, wire=make_wire(transport), replica_tp=r.replica_tp,
                                         timeout_s=r.sync_timeout_s, bucket_bytes=r.sync_bucket_mb << 20,
                                         address=r.rendezvous_address, base_port=r.rendezvous_port,
                                         stage=layout.pp_rank)
            else:
                sender = HostMemorySender(urls, key, timeout_s=r.sync_timeout_s, bucket_bytes=r.sync_bucket_mb << 20,
                                          transport=transport)
        return cls(ctrl, urls, r.weight_update, r.sync_timeout_s, layout.pp_rank, pool, sender, send_dtype=send_dtype,
                   schedule=DeltaSchedule(full_every) if full_every else None)

    @classmethod
    def local(cls, pool: ReplicaPool, sender: WeightSender, *, full_every: int = 0,
              mode: UpdateMode = "between_batches", timeout_s: float = 300.0,
              send_dtype: torch.dtype | None = None) -> "WeightUpdate":
        """The whole update in this one process (rank 0 and the only stage's sender): tests, tools
        and benchmarks. `send_dtype`: default the replicas' (`pool.spec.dtype`)."""
        dtype = send_dtype if send_dtype is not None else getattr(torch, pool.spec.dtype, torch.float32)
        return cls(None, list(pool.urls), mode, timeout_s, 0, pool, sender, send_dtype=dtype,
                   schedule=DeltaSchedule(full_every) if full_every else None)

    def _from_rank0(self, obj: Any) -> Any:
        return obj if self.ctrl is None else from_rank0(obj, self.ctrl)

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
             replica_ids: Sequence[int] | None = None, *, check: bool = True, resync: bool | None = None) -> PushResult:
        """All ranks: update the replicas (all, or `replica_ids`) to `version`; this stage's result
        (an empty one on ranks that only take part in the TP gathers). `resync` (default: whether
        `replica_ids` names some): what was kept for the targets is stale (they restarted or
        failed), so it is forgotten first. `check`: raise `WeightSyncError` where the run must
        stop, else return why in `result.stop`."""
        opened = self._from_rank0(self.pool.begin_update(replica_ids, self.mode, self.timeout_s) if self.pool else None)
        resync = replica_ids is not None if resync is None else resync
        result, refused = self._stream(version, named_tensors, opened, resync=resync)
        result.opened = opened
        counts = (self.encoder.changed, self.encoder.compared) if self.encoder is not None and opened else (0, 0)
        report = (sorted(result.failed), refused, counts)
        reports: list = [report]
        if self.ctrl is not None:
            reports = [None] * dist.get_world_size(self.ctrl)
            dist.all_gather_object(reports, report, group=self.ctrl)
        if self.pool is not None and (compared := sum(c for _, _, (_, c) in reports)):
            result.changed_fraction = sum(c for _, _, (c, _) in reports) / compared
        verdict = self._publish(version, opened, reports, result) if self.pool is not None else None
        result.stop = self._from_rank0(verdict)
        if check and result.stop:
            raise WeightSyncError(result.stop)
        return result

    def _stream(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], opened: list[int],
                resync: bool) -> tuple[PushResult, str | None]:
        """Phase 2 on this rank -> (its result, why a replica refused the run's configuration)."""
        if self.sender is None or self.encoder is None or not opened:
            for _ in named_tensors:  # take part in the TP gathers
                pass
            return PushResult(), None
        targets = [self.urls[i] for i in opened]
        if resync:  # restarted (or failed) replicas: what was kept for them is stale
            self.forget(targets)
        delta = self.schedule is not None and self.schedule.begin(targets)
        dtype = self.send_dtype  # a no-op cast where the learner's dtype is the replicas'
        stream = self.encoder.encode(((name, t.to(dtype)) for name, t in named_tensors), delta)
        try:
            result = self.sender.push(stream, urls=targets, keep=self.schedule is not None)
        except WeightSyncError as e:
            for _ in stream:  # the rest of the gathers, for the stage's other ranks
                pass
            return PushResult(failed={u: str(e) for u in targets}), str(e)
        result.delta = delta
        if self.schedule is not None:
            self.schedule.end([u for u in targets if u not in result.failed], delta)
        if result.failed:
            log.warning("weight sync of version %d, stage %d: replicas dropped: %s", version, self.stage, result.failed)
        return result, None

    def _publish(self, version: int, opened: list[int], reports: list, result: PushResult) -> str | None:
        """Rank 0, phases 3-4: publish where every stage arrived -> why the run must stop, or None."""
        assert self.pool is not None
        failed = {url for urls, _, _ in reports for url in urls}
        if refused := next((why for _, why, _ in reports if why), None):
            self.pool.finish_update(version, [], abandoned=opened)
            return refused
        complete = [i for i in opened if self.urls[i] not in failed]
        result.published = self.pool.finish_update(version, complete, [i for i in opened if i not in complete])
        refusing = self.pool.up([i for i in opened if i not in result.published])
        if opened and not result.published and refusing:
            return f"weight sync of version {version} reached no replica; replicas {refusing} are up and refused it"
        return None

    def forget(self, urls: Sequence[str]) -> None:
        """These replicas restarted or failed: their next push is full and re-forms what the
        sender kept for them."""
        if self.sender is not None:
            self.sender.forget(urls)
        if self.schedule is not None:
            self.schedule.forget(urls)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
