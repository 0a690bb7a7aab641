"""The interface every weight sender implements, and what one push returns.

A sender lives on the sender rank of one learner pipeline stage (its TP rank 0 of DP rank 0) for
the whole run. Each sync, after rank 0 opened a vLLM weight update on the target replicas
(`/start_weight_update`), it carries the stream `weights/update.py` built (the stage's HF-named
tensors, cast, and deltas where the push is one) into those updates as buckets of
`/update_weights` calls; rank 0 then publishes the version (`weights/update.py` runs the phases).
A sender only carries: what changed, and whether a push is a delta, are `WeightUpdate`'s.

Implementations (`rollout.weight_transport`):
- `host_memory.HostMemorySender` (auto / shm / http): each bucket is a safetensors payload in a
  shared-memory segment or inline in the request; the replicas run our `mas_cpu` engine;
- `broadcast.BroadcastSender` (nccl / gloo): each bucket's tensors are broadcast on a process
  group per replica while its `/update_weights` call receives them; the replicas run vLLM's NCCL
  engine (`mas_nccl`) or the same engine with a gloo communicator (`mas_gloo`).

Contract of `push`: it always drains `named_tensors` (the stage's other ranks take part in the TP
gathers behind that iterator), bounds every wait by the sender's timeout, and reports a replica
that failed in `PushResult.failed` instead of raising; it raises only for what no retry can fix
(a replica configured unlike the run); `keep` asks every replica to keep what it loads (the base
of the next delta, weights/delta.py). `forget` drops what the sender keeps for a replica (its
group, its checksum state), so that the next push forms it anew; `close` releases everything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch


class WeightSyncError(RuntimeError):
    """A weight sync cannot go on: a replica refused it or is configured unlike the run."""


@dataclass
class PushResult:
    """One stage's push into the replicas' open weight update."""

    bytes: int = 0  # one copy of this stage's payload
    replicas: int = 0  # replicas that received every bucket
    buckets: int = 0
    seconds: float = 0.0  # wall, including producing the tensors (the TP gathers)
    send_seconds: float = 0.0  # waiting for the replicas
    failed: dict[str, str] = field(default_factory=dict)  # url -> why it was dropped from this push
    carriers: list[str] = field(default_factory=list)  # how the bytes travelled: shm, http, nccl, gloo
    delta: bool = False  # only the changed elements were sent (weights/delta.py)
    changed_fraction: float | None = None  # rank 0: of every stage's weights, since the last push (weights/delta.py)
    opened: list[int] = field(default_factory=list)  # the replicas that opened the update (weights/update.py)
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
