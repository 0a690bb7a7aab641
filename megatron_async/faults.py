"""Fault injection for the reliability tests: environment variables read at a few fixed points.

Each one makes the real processes fail the way production does, so tests exercise the real
recovery paths (not mocks):

    MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT=N   the learner SIGKILLs itself right after writing
                                              checkpoint step_N (a crash between steps)
    MEGATRON_ASYNC_NAN_LOSS_STEPS=2,3          the loss of these learner steps becomes NaN
                                              (a numerical blow-up; the step must be skipped)

Unset (the default) they cost one dictionary lookup per step.
"""
from __future__ import annotations

import os
import signal

CRASH_AFTER_CHECKPOINT = "MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT"
NAN_LOSS_STEPS = "MEGATRON_ASYNC_NAN_LOSS_STEPS"


def crash_after_checkpoint(step: int) -> None:
    if os.environ.get(CRASH_AFTER_CHECKPOINT) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def nan_loss_at(step: int) -> bool:
    steps = os.environ.get(NAN_LOSS_STEPS, "")
    return str(step) in steps.split(",")
