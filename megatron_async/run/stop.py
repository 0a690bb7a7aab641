"""Stopping a run from outside: SIGTERM / SIGUSR1 save the run's place at a step boundary, then exit 75.

What schedulers send and what each rank does (`StopSignals`, installed on every learner rank):

    SIGTERM   scancel, a time limit, preemption     finish the current learner step (its weight
    SIGUSR1   SLURM's warning (`--signal=USR1@300`)  push included), save a checkpoint at that
                                                     step boundary, close the replicas, remove
                                                     the run's /dev/shm segments, print one line,
                                                     exit with EXIT_REQUEUE (75, sysexits'
                                                     EX_TEMPFAIL: "try again", i.e. requeue me)
    a second SIGTERM / SIGUSR1 / SIGINT, or          stop at once: the run's shared-memory
    run.stop_deadline_s after the first one          segments are unlinked and the process exits
                                                     75; the previous checkpoint is intact (saves
                                                     are atomic: a half-written one is never loaded)
    SIGINT (Ctrl-C) first                            KeyboardInterrupt as usual: everything is
                                                     closed, and rank 0 prints one line (the last
                                                     checkpoint, how to resume), no traceback

A signal that several senders fan out to one rank (SLURM signals every process of a job step, and
torchrun forwards what it receives to its workers) reaches that rank more than once within
milliseconds: repeats within DUPLICATE_WINDOW_S of the first count as the same signal. The ranks
agree on stopping with one all-reduce per step on the control group (`agreed`), as Megatron-LM's
exit-signal handler does, so a signal that reached any one rank stops all of them at the same
boundary.

The handler only records: the loop reads `requested` at its boundaries (and while rank 0 waits
for a batch), so no step, weight push or checkpoint is cut in half by a first signal. A process
forked from a rank (dist_checkpointing's writers, forked for each save) is that rank's helper: it
ignores SIGTERM and SIGUSR1, so a signal sent to every process of the job (`timeout`, SLURM) leaves
the writes of the save it serves to finish; the rank decides when to stop.

The launcher's side (`run/launch.py`): a run's last line on rank 0 says how it ended, what was
saved and the command that continues it (`exit_status`, `resume_command`). A launcher that
relaunched itself under torchrun forwards the signals it receives to the ranks and reports their
stop as its own exit status (`run_forwarding_signals`); killed itself (SIGKILL), it takes them
with it: torchrun gets SIGTERM from the kernel then (PR_SET_PDEATHSIG), and stops its ranks as
for any SIGTERM it receives (SIGTERM, then SIGKILL after its shutdown timeout).
"""
from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from megatron_async.config import Config
from megatron_async.observability.logs import say

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75  # sysexits.h EX_TEMPFAIL: the run saved its place and can be continued (--resume)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 2.0  # one signal fanned out by several senders arrives within milliseconds
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a process gets when its parent dies


@dataclass(frozen=True)
class Stopped:
    """How a run stopped on a signal: what `Trainer.train` returns instead of finishing."""
    signal: str  # "SIGTERM" or "SIGUSR1"
    next_step: int  # the learner step a resumed run starts with
    checkpoint: Path  # saved at that boundary (or the periodic one already there)


class StopSignals:
    """The run's stop requests from signals (module docstring). One per process, `install`ed on
    the main thread before the run is built; `uninstall` restores the previous handlers."""

    def __init__(self, deadline_s: float, *, at_once: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.deadline_s = deadline_s
        self.signal: str | None = None  # the first stop signal, once one came
        self._first_at: float | None = None
        self._at_once = at_once  # never returns: unlink, then os._exit (tests pass a recorder)
        self._clock = clock
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal's
        self._deadline: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> "StopSignals":
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self.handle)
        global _fork_hook_registered
        if not _fork_hook_registered:  # os.register_at_fork's hooks cannot be removed: one per process
            os.register_at_fork(after_in_child=_ignore_in_forked_helper)
            _fork_hook_registered = True
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._deadline is not None:
            self._deadline.cancel()

    def handle(self, signum: int, frame=None) -> None:
        name = signal.Signals(signum).name
        now = self._clock()
        if self._first_at is None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal, self._first_at = name, now
            log.warning("%s received: finishing this learner step, then saving a checkpoint and stopping "
                        "(a second signal, or %.0f s from now, stops at once)", name, self.deadline_s)
            self._deadline = threading.Timer(self.deadline_s, self._at_once, (f"run.stop_deadline_s={self.deadline_s:g} passed",))
            self._deadline.daemon = True
            self._deadline.start()
        elif now - self._first_at > DUPLICATE_WINDOW_S:
            self._at_once(f"a second signal ({name})")

    def agreed(self, group: dist.ProcessGroup) -> str | None:
        """All ranks of `group`: the stop signal if any rank received one (its name where this rank
        did, else SIGTERM), else None. One all-reduce of one integer."""
        if dist.get_world_size(group) == 1:
            return self.signal
        flag = torch.tensor([1 if self.requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and self.signal is None:
            self.signal = "SIGTERM"  # another rank's; this rank's own deadline does not run
        return self.signal if flag.item() else None


_fork_hook_registered = False


def _ignore_in_forked_helper() -> None:
    """In a process just forked from one whose stop signals a `StopSignals` handles: ignore them
    (module docstring). The handler's state (a first signal, its deadline) stays the rank's."""
    for sig in STOP_SIGNALS:
        if isinstance(getattr(signal.getsignal(sig), "__self__", None), StopSignals):
            signal.signal(sig, signal.SIG_IGN)


def stop_at_once(reason: str, unlink: Callable[[], int]) -> None:
    """The second signal's or the deadline's path: no checkpoint, no waiting; shared memory is
    unlinked first (os._exit runs no finalizers)."""
    freed = unlink()
    log.error("stopping at once: %s; %d shared-memory segment(s) removed; the previous checkpoint is intact", reason, freed)
    logging.shutdown()
    os._exit(EXIT_REQUEUE)


# -- the launcher's side ----------------------------------------------------------------------------
def exit_status(ended: Stopped | KeyboardInterrupt | Exception | None, cfg: Config, resume: str,
                relaunched: bool, last_checkpoint: Path | None) -> int:
    """A learner rank's exit status for how its run `ended` (None: every step ran; an Exception: a
    checkpoint save failed, on every rank); rank 0 says in one line what was saved
    (`last_checkpoint`, the run's `latest`) and how to continue (`resume`). `relaunched`: under this
    command's own relaunch, whose launcher reports a stop (torchrun would call EXIT_REQUEUE a failure)."""
    if ended is None:
        return 0
    if int(os.environ.get("RANK", 0)) == 0:
        say(f"megatron-async: {_how_it_ended(ended, cfg, resume, last_checkpoint)}", sys.stderr)
    if isinstance(ended, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(ended, Stopped):
        return 0 if relaunched else EXIT_REQUEUE
    return 1


def _how_it_ended(ended: Stopped | KeyboardInterrupt | Exception, cfg: Config, resume: str,
                  last: Path | None) -> str:
    if isinstance(ended, Stopped):
        return (f"stopped by {ended.signal} at step {ended.next_step} of {cfg.trainer.steps}; "
                f"checkpoint {ended.checkpoint}; continue with: {resume}")
    if isinstance(ended, KeyboardInterrupt):
        saved = f"the last checkpoint is {last}" if last else "no checkpoint was saved yet"
        return f"interrupted (Ctrl-C); {saved}; continue with: {resume}"
    # a save failed (a full disk, a read-only folder), on every rank
    return f"{ended}; once that is fixed, continue with: {resume}" if last else str(ended)


def resume_command(config_path: str, overrides: list[str]) -> str:
    """The command that continues this run: from `latest`, which a run.resume_from run has moved to
    its own checkpoints, so that override is left out (repeated, it would go back again)."""
    kept = [o for o in overrides if not o.startswith("run.resume_from=")]
    return shlex.join(["megatron-async", "train", config_path, *kept, "--resume"])


def run_forwarding_signals(cmd: list[str], env: dict[str, str], started: Callable[[int], None]) -> int:
    """Run torchrun (`started` gets its pid first); SIGTERM, SIGUSR1 and SIGINT sent to this
    launcher go to the ranks (torchrun's children; torchrun itself until it has started them).
    Exit: the ranks' status, or EXIT_REQUEUE when a stop signal was forwarded and the ranks
    stopped cleanly.

    torchrun runs in a process group of its own (its ranks in sessions of their own, torchrun's
    doing), so a signal to this launcher's group (`timeout`, `kill -TERM -PGID`, Ctrl-C) reaches
    the ranks once, through here: torchrun itself, signalled, would stop its agent with an error
    (exit 1, SignalException) while the ranks still save. Only should this launcher die is
    torchrun signalled (SIGTERM, `term_when_parent_dies`): nothing would forward signals then."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it
    launcher = os.getpid()

    def term_when_parent_dies() -> None:  # in the child, before torchrun's exec (which keeps it)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died before the prctl: no signal will come
            os._exit(128 + signal.SIGTERM)

    proc = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=term_when_parent_dies)
    started(proc.pid)
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        ranks = psutil.Process(proc.pid).children()
        for target in ranks or [proc]:
            target.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0 and any(sig in STOP_SIGNALS for sig in forwarded):
        return EXIT_REQUEUE
    return code
