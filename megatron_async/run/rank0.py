"""Learner rank 0's part of the loop (`Rank0`), and its null twin on every other rank (`NullRank0`).

Rank 0 drives the run: its rollout side (`run/rollout_state.py`: prompts, pool, scorer, producer,
controllers) generates the batches, it decides what every rank does while they wait, it evaluates
on the held-out prompts and it records each step (`run/report.py`). `Trainer.train` makes the same
calls on every rank: a `NullRank0` does nothing, and where rank 0 answers for all (`take`,
`next_command`, `replica_address`) it answers None, which `from_rank0` replaces by rank 0's answer.
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

from megatron_async.observability.tracking import Tracker
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.producer import RolloutBatch, RolloutProducer
from megatron_async.run import faults
from megatron_async.run.report import StepReport
from megatron_async.run.rollout_state import RolloutState

Command = tuple[str, list[int]]  # what every rank does next while they wait: ("ready" | "stop" | "resync", replica ids)


class Rank0:
    """Learner rank 0's rollout side, step report and held-out evaluation (module docstring)."""

    def __init__(self, rollout: RolloutState, report: StepReport, tracker: Tracker):
        self.rollout, self.report, self.tracker = rollout, report, tracker

    @property
    def pool(self) -> ReplicaPool:
        return self.rollout.pool

    @property
    def producer(self) -> RolloutProducer:
        """The running producer (`start_producer`)."""
        if self.rollout.producer is None:
            raise RuntimeError("the rollout producer is not started yet (Rank0.start_producer)")
        return self.rollout.producer

    def replica_address(self) -> tuple[list[str], str, str]:
        """The replicas' URLs, their key, and the machine that started them (for `check_reachable`)."""
        return self.pool.urls, self.pool.key, socket.gethostname()

    def start_producer(self, first_batch: int) -> None:
        self.rollout.start_producer(first_batch=first_batch)

    def evaluate(self, tag: str, version: int) -> float | None:
        """The held-out reward of the weights the replicas hold (None without eval prompts)."""
        return self.rollout.evaluate(tag, version, self.tracker)

    def next_command(self, ready: Callable[[Rank0], bool], give_up: Callable[[Rank0], bool]) -> Command:
        """What every rank does next while they wait (`Trainer._wait_until`): stop once `give_up`
        holds, push weights to restarted replicas, go on once `ready` holds; until then, wait here."""
        while True:
            if give_up(self):
                return "stop", []
            if stale := [r.replica_id for r in self.pool.replicas_needing_weights(wait_s=0)]:
                return "resync", stale  # before `ready`: a full push leaves restarted replicas out
            if ready(self):
                return "ready", []
            self.producer.wait(1.0)

    def take(self, step: int) -> tuple[RolloutBatch, int]:
        """Batch `step`, generated, and T, the learner's passes over it."""
        return self.producer.take(step), self.rollout.updates_per_batch()

    def restart_replica_at(self, step: int) -> None:
        """Fault injection (run/faults.py): restart replica 0 before learner step `step` trains."""
        faults.restart_replica_at(step, self.pool, self.producer)

    def notify_synced(self, version: int) -> None:
        self.producer.notify_synced(version)

    def record(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """Learner step `step` trained `batch`: the rollout side's and the batch's metrics join
        `metrics` (in place: the bad-step guard reads them), the report logs them, the controllers move."""
        metrics.update(self.rollout.step_metrics())
        self.report.record(step, batch, metrics)
        self.rollout.after_step(step, batch, metrics)

    def finish(self, before: float | None, after: float | None, checkpoint: Path | None, resumed_at: int | None) -> None:
        """The end-of-run report (`StepReport.finish`)."""
        self.report.finish(before, after, len(self.rollout.eval_prompts), checkpoint, resumed_at=resumed_at)

    def close(self) -> None:
        self.rollout.close()


class NullRank0:
    """Every other rank's `Rank0` (module docstring): it holds nothing and does nothing."""

    rollout: None = None  # the run checkpoint saves rank 0's parts
    report: None = None
    pool: None = None

    def replica_address(self) -> None:
        return None

    def start_producer(self, first_batch: int) -> None: ...

    def evaluate(self, tag: str, version: int) -> None:
        return None

    def next_command(self, ready: Callable[[Rank0], bool], give_up: Callable[[Rank0], bool]) -> None:
        return None

    def take(self, step: int) -> None:
        return None

    def restart_replica_at(self, step: int) -> None: ...

    def notify_synced(self, version: int) -> None: ...

    def record(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None: ...

    def finish(self, before: float | None, after: float | None, checkpoint: Path | None, resumed_at: int | None) -> None: ...

    def close(self) -> None: ...
