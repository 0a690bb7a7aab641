"""One weight update, end to end: `WeightUpdate.push`, called by every learner rank, and the
interface of the senders it drives (`WeightSender`, `PushResult`).

    weights = build_weight_update(cfg, plan, layout, ctrl, pool, urls, key)   # once per run (weights/build.py)
    result = weights.push(version, iter_hf_weights(model))              # each sync (or a re-sync of some replicas)

    weights = WeightUpdate.local(pool, sender)                           # one process: tests, tools, benchmarks

Phases (vLLM's weight-transfer API), and who runs them:
1. rank 0 opens the update on each target replica (`ReplicaPool.begin_update`: pause,
   `/start_weight_update`) and tells every rank which ones opened;
2. the sender rank of each pipeline stage (its TP rank 0 of DP rank 0) builds the stage's stream
   once, here: its HF tensors cast to the replicas' dtype (`model.dtype`; an fp32 learner sends
   bf16 replicas half the bytes), compared with what the last push sent by one exact, bit-based
   comparison (weights/delta.py's `DeltaEncoder`), which gives both the changed count and, on a
   push the `DeltaSchedule` allows, the deltas. A sender only carries that stream into the opened
   replicas (`WeightSender`, below: weights/host_memory.py or weights/broadcast.py, chosen by
   `rollout.weight_transport` in weights/build.py); the stage's other ranks only take part in the
   TP gathers behind `named_tensors`;
3. every rank reports the replicas its stage could not reach, and its changed count; rank 0
   publishes the version on those every stage reached (`ReplicaPool.finish_update`: verify,
   `/finish_weight_update`, resume) and closes the update without a version on the others; its
   result carries the fraction changed over every stage (`weight_sync/changed_fraction`);
4. the verdict: a replica left out is not fresh (its pool restarts it if it died, and the loop
   re-syncs it before it takes work). The run stops (`WeightSyncError`, on every rank) only when
   an update reached no replica while some target is up and refusing it (retrying would loop; one
   dropped only with its node group is not refusing: its re-sync goes alone, weights/broadcast.py), or
   when a replica is configured unlike the run (`push(check=False)` returns it in `stop` instead).

`local` is the same update in one process, rank 0 and the only stage's sender at once (no process
group), for tests, tools and benchmarks.

The sender interface. A sender lives on the sender rank of one learner pipeline stage for the
whole run. Each sync it carries the stream built here into the opened updates as buckets of
`/update_weights` calls, grouped by `group_by_cap` (every sender buckets by the same rule); what
changed, and whether a push is a delta, are `WeightUpdate`'s. Implementations
(`rollout.weight_transport`):
- `host_memory.HostMemorySender` (auto / shm / http): each bucket is a safetensors payload in a
  shared-memory segment or inline in the request; the replicas run our `mas_cpu` engine;
- `broadcast.BroadcastSender` (nccl / gloo): each bucket's tensors are broadcast on a process
  group per replica node while its `/update_weights` call receives them; the replicas run vLLM's NCCL
  engine (`mas_nccl`) or the same engine with a gloo communicator (`mas_gloo`).
Contract of `push`: it always drains `named_tensors` (the stage's other ranks take part in the TP
gathers behind that iterator), bounds every wait by the sender's timeout, and reports a replica
that failed in `PushResult.failed` instead of raising; it raises (`WeightSyncError`) only for what
no retry can fix (a replica configured unlike the run); `keep` asks every replica to keep what it
loads (the base of the next delta, weights/delta.py). `forget` drops what the sender keeps for a
replica (its group, its checksum state), so that the next push forms it anew; `close` releases
everything.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_async.learner.parallel import from_rank0
from megatron_async.rollout.pool import ReplicaPool, UpdateMode
from megatron_async.weights.delta import DeltaEncoder, DeltaSchedule

log = logging.getLogger(__name__)


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
    send_dtype: torch.dtype = torch.float32  # the replicas' (the run plan's model_dtype): tensors are sent in it
    schedule: DeltaSchedule | None = None  # delta sync (rollout.sync_full_every), on the stage's sender rank
    # >1: the pipeline stages stream in turn, stage s in turn s between barriers on `ctrl` (node
    # groups, weights/build.py says why); 1: all at once
    stage_turns: int = 1

    def __post_init__(self) -> None:
        if self.sender is not None and self.encoder is None:
            self.encoder = DeltaEncoder(keep_whole=self.schedule is not None)

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
        result, refused = PushResult(), None
        for turn in range(self.stage_turns):
            if self.stage_turns == 1 or turn == self.stage:
                result, refused = self._stream(version, named_tensors, opened, resync=resync)
            if self.stage_turns > 1:
                dist.barrier(group=self.ctrl)
        result.opened = opened
        counts = (self.encoder.changed, self.encoder.compared) if self.encoder is not None and opened else (0, 0)
        report = (sorted(result.failed), refused, counts, result.failed_with_group)
        reports: list = [report]
        if self.ctrl is not None:
            reports = [None] * dist.get_world_size(self.ctrl)
            dist.all_gather_object(reports, report, group=self.ctrl)
        if self.pool is not None and (compared := sum(c for _, _, (_, c), _ in reports)):
            result.changed_fraction = sum(c for _, _, (c, _), _ in reports) / compared
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
        failed = {url for urls, _, _, _ in reports for url in urls}
        if refused := next((why for _, why, _, _ in reports if why), None):
            self.pool.finish_update(version, [], abandoned=opened)
            return refused
        complete = [i for i in opened if self.urls[i] not in failed]
        result.published = self.pool.finish_update(version, complete, [i for i in opened if i not in complete])
        # dropped only with a node group (every stage's failure of it so): re-synced alone, not refusing
        with_group = {url for urls, _, _, grouped in reports for url in grouped} - {
            url for urls, _, _, grouped in reports for url in urls if url not in grouped}
        refusing = self.pool.up([i for i in opened if i not in result.published and self.urls[i] not in with_group])
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


# ----------------------------------------------------------------------------- the sender interface


class WeightSyncError(RuntimeError):
    """A weight sync cannot go on: a replica refused it or is configured unlike the run."""


@dataclass
class PushResult:
    """One stage's push into the replicas' open weight update."""

    bytes: int = 0  # one copy of this stage's payload
    replicas: int = 0  # replicas that received every bucket
    buckets: int = 0  # buffers of this stage's stream (host memory: one per call; broadcast: packed, in one call)
    calls: int = 0  # /update_weights calls carrying them, per replica
    seconds: float = 0.0  # wall, including producing the tensors (the TP gathers)
    send_seconds: float = 0.0  # waiting for the replicas
    failed: dict[str, str] = field(default_factory=dict)  # url -> why it was dropped from this push
    # of `failed`: dropped with a node group of several (weights/broadcast.py): not counted as refusing
    failed_with_group: list[str] = field(default_factory=list)
    carriers: list[str] = field(default_factory=list)  # how the bytes travelled: shm, http, nccl, gloo
    delta: bool = False  # only the changed elements were sent (weights/delta.py)
    changed_fraction: float | None = None  # rank 0: of every stage's weights, since the last push (weights/delta.py)
    opened: list[int] = field(default_factory=list)  # the replicas that opened the update (phase 1)
    published: list[int] = field(default_factory=list)  # rank 0: the replicas that now serve the version
    stop: str | None = None  # why the run must stop (WeightUpdate.push(check=False)); None: go on

    @property
    def bytes_total(self) -> int:
        return self.bytes * self.replicas

    @property
    def gb_per_s(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSender(Protocol):
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], urls: Sequence[str] | None = None,
             keep: bool = False) -> PushResult:
        """Carry the tensors into the open update of every replica in `urls` (None: all)."""

    def forget(self, urls: Iterable[str]) -> None:
        """Drop what is kept for these replicas (they restarted or failed): re-formed at their next push."""

    def close(self) -> None:
        """Release every connection, group and buffer."""


def group_by_cap(
    named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a lazy stream of (name, tensor) into lists of at most `cap_bytes` tensor bytes.

    A tensor larger than the cap forms a group of its own. Empty groups are never yielded.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > cap_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group
