"""Fault injection for the reliability tests: environment variables read at a few fixed points.

Each one makes the real processes fail the way production does, so tests exercise the real
recovery paths (not mocks):

    MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT=N   the learner SIGKILLs itself right after writing
                                              checkpoint step_N (a crash between steps)
    MEGATRON_ASYNC_NAN_LOSS_STEPS=2,3          the loss of these learner steps becomes NaN
                                              (a numerical blow-up; the step must be skipped)
    MEGATRON_ASYNC_KILL_REPLICA_AT_BATCH=2     replica 0 is SIGKILLed shortly after generation of
                                              batch 2 starts (a replica dying mid-generation)

Unset (the default) they cost one dictionary lookup per step.
"""
from __future__ import annotations

import os
import signal
import threading

CRASH_AFTER_CHECKPOINT = "MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT"
NAN_LOSS_STEPS = "MEGATRON_ASYNC_NAN_LOSS_STEPS"
KILL_REPLICA_AT_BATCH = "MEGATRON_ASYNC_KILL_REPLICA_AT_BATCH"


def crash_after_checkpoint(step: int) -> None:
    if os.environ.get(CRASH_AFTER_CHECKPOINT) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def poison_loss_at(step: int, loss_fn):
    """`loss_fn`, or at a step listed in MEGATRON_ASYNC_NAN_LOSS_STEPS the same loss times NaN."""
    if str(step) not in os.environ.get(NAN_LOSS_STEPS, "").split(","):
        return loss_fn

    def nan_loss(logprobs, mb):
        loss, metrics = loss_fn(logprobs, mb)
        return loss * float("nan"), metrics

    return nan_loss


def kill_replica_during(batch_index: int, replica_pgid: int, delay_s: float = 0.3) -> None:
    """SIGKILL replica 0's whole process group (its vLLM server, engine core and workers)."""
    if os.environ.get(KILL_REPLICA_AT_BATCH) == str(batch_index):
        threading.Timer(delay_s, os.killpg, (replica_pgid, signal.SIGKILL)).start()
