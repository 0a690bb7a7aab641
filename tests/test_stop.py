"""Stopping a run (run/stop.py) in-process: the signal logic, the loop's stop at a step boundary
(the fakes of tests/test_trainer_loop.py), and the /dev/shm sweep (weights/host_memory.py). No process
starts but one fork and a launcher's torchrun stand-in (integration); tests/test_stop_e2e.py sends the
signals to real runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_async.run.stop import DUPLICATE_WINDOW_S, Stopped, StopSignals
from megatron_async.weights import host_memory as shm
from megatron_async.weights.update import WeightSyncError
from tests.test_trainer_loop import make_trainer, no_files  # noqa: F401 (fixture)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def signals(deadline_s=60.0, clock=None):
    stopped_at_once: list[str] = []
    done = threading.Event()

    def at_once(why):
        stopped_at_once.append(why)
        done.set()

    return StopSignals(deadline_s, at_once=at_once, clock=clock or Clock()), stopped_at_once, done


def test_a_first_stop_signal_is_recorded_and_repeats_of_it_within_the_window_are_the_same_signal():
    clock = Clock()
    stop, at_once, _ = signals(clock=clock)
    assert not stop.requested
    stop.handle(signal.SIGUSR1)
    assert stop.requested and stop.signal == "SIGUSR1" and at_once == []
    clock.now += DUPLICATE_WINDOW_S / 2  # SLURM's copy and torchrun's forward of one signal
    stop.handle(signal.SIGUSR1)
    stop.handle(signal.SIGTERM)
    assert at_once == [] and stop.signal == "SIGUSR1"
    clock.now += DUPLICATE_WINDOW_S
    stop.handle(signal.SIGTERM)
    assert at_once == ["a second signal (SIGTERM)"]
    stop.uninstall()


def test_ctrl_c_first_is_a_keyboard_interrupt_and_after_a_stop_signal_it_stops_at_once():
    clock = Clock()
    stop, at_once, _ = signals(clock=clock)
    with pytest.raises(KeyboardInterrupt):
        stop.handle(signal.SIGINT)
    assert not stop.requested
    stop.handle(signal.SIGTERM)
    clock.now += DUPLICATE_WINDOW_S + 1
    stop.handle(signal.SIGINT)
    assert at_once == ["a second signal (SIGINT)"]
    stop.uninstall()


def test_the_deadline_stops_at_once_when_the_boundary_is_not_reached():
    stop, at_once, done = signals(deadline_s=0.01)
    stop.handle(signal.SIGTERM)
    assert done.wait(10), "the deadline never fired"
    assert at_once == ["run.stop_deadline_s=0.01 passed"]


def test_install_routes_the_signals_to_it_and_uninstall_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    stop, _, _ = signals()
    stop.install()
    try:
        assert all(signal.getsignal(s) == stop.handle for s in before)
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread before the next bytecode
        assert stop.signal == "SIGUSR1"
    finally:
        stop.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.integration  # forks this process (a child that exits at once)
def test_a_process_forked_while_the_signals_are_listened_to_ignores_the_stop_signals():
    """What dist_checkpointing's writers are: forked from a rank mid-save, they must outlive a signal
    sent to every process of the job; the rank alone decides to stop."""
    stop, _, _ = signals()
    stop.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 if the signals neither killed it nor reached its copy of the handler
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0 if stop.signal is None else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        stop.uninstall()
    assert os.waitstatus_to_exitcode(status) == 0  # 1: the inherited handler recorded a stop; -15: SIGTERM killed it
    assert stop.signal is None  # the child's signals were its own


LAUNCHER = """
import os, sys
from pathlib import Path
from megatron_async.run.stop import run_forwarding_signals
out = Path(sys.argv[1])
sys.exit(run_forwarding_signals([sys.executable, "-c", sys.argv[2], str(out)], dict(os.environ),
                                started=lambda pid: (out / "torchrun.pid").write_text(str(pid))))
"""
TORCHRUN = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def term(signum, frame):
    (out / "got").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
(out / "ready").write_text("")
time.sleep(300)
"""


@pytest.mark.integration  # a launcher process and the torchrun stand-in it starts
def test_the_torchrun_of_a_launcher_killed_with_sigkill_gets_sigterm(tmp_path):
    """Nothing forwards signals once the launcher is gone: torchrun must stop its ranks itself."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), textwrap.dedent(TORCHRUN)])
    torchrun = None
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.1)
        torchrun = int((tmp_path / "torchrun.pid").read_text())  # what the lock names (`started`)
        launcher.kill()
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 60
        while not (tmp_path / "got").exists():
            assert time.monotonic() < deadline, "torchrun got no signal when its launcher died"
            time.sleep(0.1)
        assert (tmp_path / "got").read_text() == "SIGTERM"
        while psutil.pid_exists(torchrun) and psutil.Process(torchrun).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "torchrun outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()
        if torchrun is not None and psutil.pid_exists(torchrun):  # this test failed: no stand-in left behind
            os.kill(torchrun, signal.SIGKILL)


# -- the loop ---------------------------------------------------------------------------------------
def stop_during_step(trainer, at_step: int):
    """The fake learner's step `at_step` receives SIGTERM (as a scheduler would send it mid-step)."""
    step = trainer.learner.step

    def stepped(batch, s, updates):
        if s == at_step:
            trainer.stop.handle(signal.SIGTERM)
        return step(batch, s, updates)

    trainer.learner.step = stepped


def test_a_signal_mid_step_finishes_the_step_with_its_push_then_checkpoints_at_the_boundary(tmp_path, one_rank_group, no_files):
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=5")
    trainer.stop, _, _ = signals()
    stop_during_step(trainer, 1)
    stopped = trainer.train()
    assert stopped == Stopped("SIGTERM", 2, Path("ckpt2"))
    assert no_files == [2]
    assert ("push", 2, None) in events.log and ("notify_synced", 2) in events.log  # step 1 whole
    assert ("train", 2) not in events.log


def test_a_boundary_with_a_periodic_checkpoint_is_not_saved_twice(tmp_path, one_rank_group, no_files):
    trainer, _ = make_trainer(tmp_path, one_rank_group, "trainer.steps=5", "trainer.checkpoint_every=2")
    trainer.stop, _, _ = signals()
    stop_during_step(trainer, 1)
    assert trainer.train() == Stopped("SIGTERM", 2, Path("ckpt2"))
    assert no_files == [2]


def test_a_push_that_fails_while_stopping_still_ends_in_the_checkpoint(tmp_path, one_rank_group, no_files):
    trainer, _ = make_trainer(tmp_path, one_rank_group, "trainer.steps=5")
    trainer.stop, _, _ = signals()
    stop_during_step(trainer, 0)

    def replicas_gone(version, tensors, replica_ids=None):
        raise WeightSyncError("every replica was dropped")

    trainer.weights.push = replicas_gone
    assert trainer.train() == Stopped("SIGTERM", 1, Path("ckpt1"))
    assert no_files == [1]


def test_with_no_replica_up_after_the_signal_the_step_stops_waiting_for_its_old_weights_batches(tmp_path, one_rank_group,
                                                                                                 no_files):
    """SLURM's SIGTERM reaches the replicas too: the batch the old weights still had to generate never
    comes, and the checkpoint at the boundary must not wait for it (nor push to no one)."""
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=5")
    trainer.stop, _, _ = signals()
    stop_during_step(trainer, 1)
    producer, pool = trainer.rank0.rollout.producer, trainer.rank0.rollout.pool
    done = producer.old_weights_done
    producer.old_weights_done = lambda step: step < 1 and done(step)  # step 1's never
    producer.wait = lambda timeout: setattr(pool, "replicas_up", False)  # they end while the loop waits
    assert trainer.train() == Stopped("SIGTERM", 2, Path("ckpt2"))
    assert no_files == [2]
    assert ("push", 1, None) in events.log and ("push", 2, None) not in events.log
    assert ("train", 2) not in events.log


def test_without_a_stop_signal_a_failed_push_still_ends_the_run(tmp_path, one_rank_group, no_files):
    trainer, _ = make_trainer(tmp_path, one_rank_group)
    trainer.stop, _, _ = signals()

    def refused(version, tensors, replica_ids=None):
        raise WeightSyncError("refused")

    trainer.weights.push = refused
    with pytest.raises(WeightSyncError):
        trainer.train()


def test_a_signal_while_rank0_waits_for_the_next_batch_stops_without_waiting_for_it(tmp_path, one_rank_group, no_files):
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=5")
    trainer.stop, _, _ = signals()
    producer = trainer.rank0.rollout.producer
    has = producer.has
    producer.has = lambda step: step < 2 and has(step)  # batch 2 never comes

    def wait(timeout):  # the signal arrives while the loop waits for batch 2
        trainer.stop.handle(signal.SIGTERM)

    producer.wait = wait
    assert trainer.train() == Stopped("SIGTERM", 2, Path("ckpt2"))
    assert ("take", 2) not in events.log


# -- /dev/shm ---------------------------------------------------------------------------------------
def a_pid_that_does_not_run() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_the_sweep_removes_only_our_segments_of_senders_that_are_gone(tmp_path):
    dead = a_pid_that_does_not_run()
    files = {name: tmp_path / name for name in (
        f"{shm.SHM_PREFIX}{dead}-aa", f"{shm.SHM_PREFIX}{os.getpid()}-bb", f"{shm.SHM_PREFIX}{dead}-other-user",
        f"other-{dead}-cc", f"{shm.SHM_PREFIX}notapid-dd")}
    for path in files.values():
        path.write_bytes(b"x" * 1000)
    if os.getuid() == 0:
        os.chown(files[f"{shm.SHM_PREFIX}{dead}-other-user"], 65534, 65534)
    else:
        files.pop(f"{shm.SHM_PREFIX}{dead}-other-user").unlink()
    assert shm.sweep_dead_segments(str(tmp_path)) == (1, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in files if n != f"{shm.SHM_PREFIX}{dead}-aa")


def test_a_stop_at_once_unlinks_this_process_segments():
    segment = shm.ShmSegment(4096)
    segment.buffer(16)
    path = segment.path
    assert path is not None and os.path.exists(path)
    assert shm.unlink_live_segments() >= 1
    assert not os.path.exists(path)
    segment.close()  # the finalizer finds nothing left to unlink
