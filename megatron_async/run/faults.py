"""Fault injection for the reliability tests: environment variables read at a few fixed points.

Each one makes the real processes fail the way production does, so tests exercise the real
recovery paths (not mocks):

    MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT=N   the learner SIGKILLs itself right after writing
                                              checkpoint step_N (a crash between steps; a
                                              background save is completed first)
    MEGATRON_ASYNC_NAN_LOSS_STEPS=2,3          the loss of these learner steps becomes NaN
                                              (a numerical blow-up; the step must be skipped)
    MEGATRON_ASYNC_KILL_REPLICA_AT_BATCH=2     replica 0 is SIGKILLed shortly after generation of
                                              batch 2 starts (a replica dying mid-generation)
    MEGATRON_ASYNC_RESTART_REPLICA_AT_STEP=1   before learner step 1 trains, once every batch the
                                              replicas' weights serve is generated, replica 0 is
                                              SIGKILLed and the pool has restarted it (a replica
                                              restarted between two pushes while the learner works)
    MEGATRON_ASYNC_SIGNAL_DURING=sync:1        the learner sends itself SIGTERM while learner step
                                              1 pushes its weights (after the first tensor); also
                                              train:N (as step N's training starts) and a third
                                              field for another signal: train:1:SIGINT (a scheduler's
                                              or a user's stop, run/stop.py); several, comma-separated:
                                              train:1,sync:1 (each one after the first sent once
                                              run/stop.py's DUPLICATE_WINDOW_S has passed since the
                                              one before it, so that it counts as a second signal)
    MEGATRON_ASYNC_SIGNAL_TO=group             ... sends them to its whole process group instead, as
                                              `timeout` and `kill -TERM -PGID` do

Unset (the default) they cost one dictionary lookup per step.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

from megatron_async.run.stop import DUPLICATE_WINDOW_S

if TYPE_CHECKING:  # annotations only
    from megatron_async.rollout.pool import ReplicaPool
    from megatron_async.rollout.producer import RolloutProducer

CRASH_AFTER_CHECKPOINT = "MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT"
NAN_LOSS_STEPS = "MEGATRON_ASYNC_NAN_LOSS_STEPS"
KILL_REPLICA_AT_BATCH = "MEGATRON_ASYNC_KILL_REPLICA_AT_BATCH"
RESTART_REPLICA_AT_STEP = "MEGATRON_ASYNC_RESTART_REPLICA_AT_STEP"
SIGNAL_DURING = "MEGATRON_ASYNC_SIGNAL_DURING"
SIGNAL_TO = "MEGATRON_ASYNC_SIGNAL_TO"


def crash_after_checkpoint(step: int, wait_for_saves: Callable[[], None]) -> None:
    """SIGKILL this process at `step` once the saves under way are written (`RunCheckpoints.wait`)."""
    if os.environ.get(CRASH_AFTER_CHECKPOINT) == str(step):
        wait_for_saves()
        os.kill(os.getpid(), signal.SIGKILL)


def poison_loss_at(step: int, loss_fn):
    """`loss_fn`, or at a step listed in MEGATRON_ASYNC_NAN_LOSS_STEPS the same loss times NaN."""
    if str(step) not in os.environ.get(NAN_LOSS_STEPS, "").split(","):
        return loss_fn

    def nan_loss(logprobs, mb):
        loss, metrics = loss_fn(logprobs, mb)
        return loss * float("nan"), metrics

    return nan_loss


def kill_replica_during(batch_index: int, replica_pgid: int | None, delay_s: float = 0.3) -> None:
    """SIGKILL replica 0's whole process group (its vLLM server, engine core and workers; its pid
    leads the group)."""
    if os.environ.get(KILL_REPLICA_AT_BATCH) == str(batch_index):
        threading.Timer(delay_s, os.killpg, (_started_here(replica_pgid, KILL_REPLICA_AT_BATCH), signal.SIGKILL)).start()


def _started_here(pid: int | None, variable: str) -> int:
    if pid is None:
        raise RuntimeError(f"{variable}: replica 0 was not started by this run (a replica_urls server): no process to kill")
    return pid


def restart_replica_at(step: int, pool: ReplicaPool, producer: RolloutProducer) -> None:
    """Rank 0: SIGKILL replica 0's process group once no batch is left
    to generate with the weights it holds, and wait (bounded by the pool's start timeout) until the
    pool has noticed and restarted it. The learner's next wait and push then meet a replica whose
    previous process the weight senders knew."""
    if os.environ.get(RESTART_REPLICA_AT_STEP) != str(step):
        return
    deadline = time.monotonic() + pool.start_timeout_s

    def within_bound(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{RESTART_REPLICA_AT_STEP}={step}: {what} after {pool.start_timeout_s:.0f} s")

    while not producer.old_weights_done(step):
        within_bound("batches of the current weights still generating")
        producer.wait(0.5)
    killed = _started_here(pool.pids()[0], RESTART_REPLICA_AT_STEP)
    os.killpg(killed, signal.SIGKILL)
    while pool.pids()[0] == killed or not pool.up([0]):
        within_bound("replica 0 not restarted")
        pool.health_check()  # notices the dead server; the pool restarts it in the background
        time.sleep(0.5)


_last_signal_sent: list[float] = []  # when signal_during sent its previous signal (time.monotonic)


def signal_during(phase: str, step: int) -> None:
    """Send this process (MEGATRON_ASYNC_SIGNAL_TO=group: its process group) the signal that
    MEGATRON_ASYNC_SIGNAL_DURING names for (phase, step)."""
    for entry in os.environ.get(SIGNAL_DURING, "").split(","):
        phase_at, step_at, *name = (entry or "::").split(":")
        if (phase_at, step_at) != (phase, str(step)):
            continue
        if _last_signal_sent:  # a second signal, not a repeat of the first (run/stop.py)
            time.sleep(max(0.0, _last_signal_sent[-1] + DUPLICATE_WINDOW_S + 0.5 - time.monotonic()))
        sig = signal.Signals[name[0] if name else "SIGTERM"]
        _last_signal_sent.append(time.monotonic())
        if os.environ.get(SIGNAL_TO) == "group":
            os.killpg(0, sig)
        else:
            os.kill(os.getpid(), sig)


def signal_mid_sync(step: int, tensors):
    """`tensors` (a weight push's stream), signalled after its first item at the step that
    MEGATRON_ASYNC_SIGNAL_DURING=sync:<step> names."""
    for i, item in enumerate(tensors):
        yield item
        if i == 0:
            signal_during("sync", step)
