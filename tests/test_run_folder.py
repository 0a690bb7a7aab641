"""One run per run folder (run/run_lock.py, run/preflight.py): a folder in use is refused naming the
run that holds it, a lock whose process is gone is taken over with one line, and a fresh run is
refused where a previous run's checkpoints are, naming --resume; nothing of that run is touched.

Fast tier: the lock's rules in-process (this process's own pid is a live holder; a pid past the
kernel's pid_max is one that is gone; pid 1 with a start time before its own is a reused pid).
Integration: real `megatron-async train` runs: two launches at once, a rerun without --resume, and
a run SIGKILLed while it holds the folder, whose successor is started as launch/quickstart.sh
starts it (a shell execs it) and counts its wall time from the command's start; a command that
relaunched itself under torchrun, SIGKILLed: its torchrun holds the folder until it has ended
(tests/test_multinode.py checks that only rank 0 of a two-node job takes the folder).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from megatron_async.config import ConfigError, load_config
from megatron_async.run.checkpoint import checkpoint_problem, latest_checkpoint
from megatron_async.run.preflight import preflight
from megatron_async.run.run_lock import LOCK_FILE, LockHolder, RunLock, check_not_in_use
from tests.e2e_utils import REPO, RLOO, assert_trained, coin_flip_data, train, train_command

GONE_PID = 2**22 + 1  # above the largest pid_max Linux allows: no process has it


def write_lock(run_dir: Path, **fields) -> Path:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": "megatron-async train x"}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({**holder, **fields}))
    return path


def test_a_folder_held_by_a_live_run_is_refused_naming_it(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    lock = RunLock.take(cfg)
    assert json.loads((cfg.run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    for attempt in (lambda: preflight(cfg), lambda: RunLock.take(cfg)):  # the preflight's check, and the atomic one
        with pytest.raises(ConfigError, match=rf"key 'run.name' = 'run': run folder {cfg.run_dir} is in use by another "
                                              rf"run \(pid {os.getpid()} on {socket.gethostname()}, started .*: .*\); "
                                              r"wait for it to finish or stop it, or choose another run.name"):
            attempt()
    lock.release()
    assert not (cfg.run_dir / LOCK_FILE).exists()
    RunLock.take(cfg).release()


def test_a_lock_whose_process_is_gone_is_taken_over_with_one_line(tmp_path, caplog):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    for stale in ({"pid": GONE_PID}, {"pid": 1, "started": 100.0}):  # gone; a pid reused since the lock was taken
        path = write_lock(cfg.run_dir, **stale)
        gone = LockHolder(**json.loads(path.read_text()))
        preflight(cfg)
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_async.run.run_lock"):
            lock = RunLock.take(cfg)
        assert [r.getMessage() for r in caplog.records] == [
            f"run folder {cfg.run_dir}: taking over the lock of a run that is gone ({gone.describe()})"]
        assert lock.holder.pid == os.getpid()
        lock.release()
    (cfg.run_dir / LOCK_FILE).write_text("{\"host\": ")  # a write cut short: names no process
    RunLock.take(cfg).release()


def test_a_lock_is_held_while_the_torchrun_it_names_runs_after_its_command_is_gone(tmp_path, caplog):
    """A relaunching command SIGKILLed: its torchrun (here: this process) may still train."""
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    lock = RunLock.take(cfg)
    lock.name_torchrun(os.getpid())
    named = json.loads((cfg.run_dir / LOCK_FILE).read_text())
    assert named["pid"] == os.getpid() and named["torchrun_pid"] == os.getpid()
    lock.release()  # the holder it wrote last is still its own
    assert not (cfg.run_dir / LOCK_FILE).exists()

    write_lock(cfg.run_dir, pid=GONE_PID, torchrun_pid=os.getpid(), torchrun_started=psutil.Process().create_time())
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {GONE_PID} \(its torchrun: pid {os.getpid()}\) "
                                          rf"on {socket.gethostname()}, started .*\); wait for it to finish or stop it"):
        RunLock.take(cfg)
    write_lock(cfg.run_dir, pid=GONE_PID, torchrun_pid=os.getpid(), torchrun_started=100.0)  # a reused torchrun pid
    with caplog.at_level("WARNING", logger="megatron_async.run.run_lock"):
        RunLock.take(cfg).release()
    assert "taking over the lock of a run that is gone" in caplog.text


def test_a_lock_from_another_host_is_refused_naming_the_file_to_remove(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    path = write_lock(cfg.run_dir, host="node-17", pid=GONE_PID)
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {GONE_PID} on node-17, .*\); it was taken on "
                                          rf"another host than this one \({socket.gethostname()}\), so whether that run "
                                          rf"still runs cannot be checked from here: wait for it, or, once it is known "
                                          rf"to be gone, remove {path}; or choose another run.name"):
        RunLock.take(cfg)
    assert path.exists()


def test_a_lock_of_an_earlier_attempt_of_this_slurm_job_is_taken_over_on_any_host(tmp_path, monkeypatch, caplog):
    """A requeued job (same SLURM_JOB_ID, SLURM_RESTART_COUNT + 1) whose earlier attempt was killed
    before it released the folder, and whose rank 0 now runs on another node."""
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(cfg.run_dir, host="node-17", pid=GONE_PID, slurm_job="4242:0")
    with caplog.at_level("WARNING", logger="megatron_async.run.run_lock"):
        lock = RunLock.take(cfg)
    assert "taking over the lock of a run that is gone (pid 4194305 on node-17, SLURM job 4242 attempt 0" in caplog.text
    assert lock.holder.slurm_job == "4242:1"
    lock.release()
    for other in ("4243:0", "4242:1"):  # another job; this same attempt (another rank 0 of it? refused)
        write_lock(cfg.run_dir, host="node-17", pid=GONE_PID, slurm_job=other)
        with pytest.raises(ConfigError, match="it was taken on another host than this one"):
            RunLock.take(cfg)


def test_release_removes_only_its_own_lock(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    lock = RunLock.take(cfg)
    path = write_lock(cfg.run_dir, pid=GONE_PID)  # taken over by another run meanwhile
    lock.release()
    assert json.loads(path.read_text())["pid"] == GONE_PID


def test_other_ranks_preflight_does_not_see_rank0s_lock(tmp_path, monkeypatch):
    """Under a torchrun started by launch/*.sh every rank runs the preflight; rank 0 holds the folder."""
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    lock = RunLock.take(cfg)
    monkeypatch.setenv("RANK", "1")
    preflight(cfg)
    lock.release()


def test_a_fresh_run_where_a_previous_run_saved_checkpoints_is_refused_naming_resume(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    for step in (10, 20):
        (cfg.run_dir / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=rf"key 'run.resume' = False: run folder {cfg.run_dir} holds a previous run "
                                          r"\(checkpoints up to step_000020\); continue it with --resume, or start over "
                                          rf"under another run.name \(or move {cfg.run_dir} away first\); nothing of it "
                                          r"is removed"):
        preflight(cfg)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    preflight(load_config(None, [f"run.out_dir={tmp_path}", "run.name=another"]))


# ------------------------------------------------------------------- real runs (integration)

STEPS = 2
SHELL_S = 12  # what the shell before the command spends (launch/quickstart.sh: the install)
RUN = [*RLOO, f"trainer.steps={STEPS}", "trainer.checkpoint_every=1"]


def wait_for_lock(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300) -> dict:
    """The lock file's holder, once `proc` has taken the folder (bounded; fails if proc exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / LOCK_FILE).exists() and (text := (run_dir / LOCK_FILE).read_text()):
            return json.loads(text)
        assert proc.poll() is None, f"the run exited {proc.returncode} before it took its folder"
        time.sleep(0.2)
    pytest.fail(f"no {LOCK_FILE} in {run_dir} after {timeout_s} s")


def refused_line(proc: subprocess.CompletedProcess) -> str:
    """The refusal: exit 2 and one line on stderr."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    return lines[0]


@contextlib.contextmanager
def session(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """`cmd` (a `megatron-async train`) as e2e_utils.train runs it, in its own session, without
    waiting; its process group is SIGKILLed on leaving the block (no code of it runs then)."""
    with open(log_path, "w") as log:  # the child writes it through its own descriptor
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)


@pytest.fixture
def data(tmp_path) -> list[str]:
    """The overrides of e2e_utils' coin-flip data set, written under tmp_path."""
    return coin_flip_data(tmp_path)


@contextlib.contextmanager
def run_holding_its_folder(tmp_path: Path, data: list[str], log_name: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A cpu_tiny `train` in a `session`, once it holds its run folder: (its process, the lock's holder)."""
    with session(train_command(tmp_path, *data, *RUN), tmp_path / log_name) as proc:
        yield proc, wait_for_lock(tmp_path / "cpu_tiny", proc)


@pytest.mark.integration
@pytest.mark.slow
def test_a_second_launch_is_refused_and_the_first_finishes_intact_and_a_rerun_needs_resume(tmp_path, data):
    run_dir = tmp_path / "cpu_tiny"
    with run_holding_its_folder(tmp_path, data, "first.log") as (first, holder):
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        second = train(tmp_path, *data, *RUN, check=False)
        assert re.fullmatch(rf"megatron-async: config error: key 'run.name' = 'cpu_tiny': run folder {run_dir} is in use "
                            rf"by another run \(pid {first.pid} on {re.escape(socket.gethostname())}, started .*\); wait "
                            r"for it to finish or stop it, or choose another run.name", refused_line(second))
        assert first.wait(timeout=900) == 0, (tmp_path / "first.log").read_text()[-4000:]
    assert_trained(run_dir, STEPS)
    latest = latest_checkpoint(load_config(str(REPO / "configs" / "cpu_tiny.yaml"), [f"run.out_dir={tmp_path}"]))
    assert latest is not None and latest.name == f"step_{STEPS:06d}" and checkpoint_problem(latest) is None
    assert not (run_dir / LOCK_FILE).exists()  # released at the end

    outputs = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    rerun = train(tmp_path, *data, *RUN, check=False)
    assert refused_line(rerun) == (
        f"megatron-async: config error: key 'run.resume' = False: run folder {run_dir} holds a previous run (checkpoints "
        f"up to step_{STEPS:06d}); continue it with --resume, or start over under another run.name (or move {run_dir} "
        "away first); nothing of it is removed")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == outputs  # nothing of the run touched


@pytest.mark.integration
@pytest.mark.slow
def test_a_lock_left_by_a_sigkilled_run_is_taken_over_with_one_line(tmp_path, data):
    with run_holding_its_folder(tmp_path, data, "killed.log") as (_, holder):
        pass  # then SIGKILLed: no code of it runs, the lock stays
    run_dir = tmp_path / "cpu_tiny"
    assert json.loads((run_dir / LOCK_FILE).read_text()) == holder
    # started as launch/quickstart.sh starts it: a shell that works first (there: the install), then execs it
    cmd = ["bash", "-c", f'sleep {SHELL_S}; exec "$@"', "bash", *train_command(tmp_path, *data, *RUN, "trainer.steps=1")]
    t0 = time.monotonic()
    with session(cmd, tmp_path / "again.log") as proc:
        assert proc.wait(timeout=900) == 0, (tmp_path / "again.log").read_text()[-4000:]
    elapsed, out = time.monotonic() - t0, (tmp_path / "again.log").read_text()
    taken = [line for line in out.splitlines() if "taking over the lock" in line]
    assert len(taken) == 1 and taken[0].endswith(f"run folder {run_dir}: taking over the lock of a run that is gone "
                                                 f"({LockHolder(**holder).describe()})"), taken
    assert_trained(run_dir, 1)
    assert not (run_dir / LOCK_FILE).exists()
    # the summary's wall time is the train command's (to 0.1 min), without the shell's seconds before it
    wall = re.search(r"wall time: ([\d.]+) min \(since the train command started\)", out)
    assert wall and float(wall[1]) * 60 <= elapsed - SHELL_S + 3, (wall and wall[0], elapsed)


@pytest.mark.integration
@pytest.mark.slow
def test_a_relaunched_run_whose_command_is_sigkilled_ends_and_holds_its_folder_till_then(tmp_path, data):
    """`train ... parallel.tp=2` relaunches itself under torchrun; its command SIGKILLed mid-run, the
    folder stays held while torchrun runs (held still here: SIGSTOP), and torchrun, its two ranks and
    the replicas then end on their own."""
    run_dir = tmp_path / "cpu_tiny"
    cfg = load_config(str(REPO / "configs" / "cpu_tiny.yaml"), [f"run.out_dir={tmp_path}"])
    with session(train_command(tmp_path, *data, *RUN, "trainer.steps=50", "parallel.tp=2"), tmp_path / "tp2.log") as proc:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "latest").exists():  # a step trained, with the replicas up
            assert proc.poll() is None, (tmp_path / "tp2.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint after 600 s"
            time.sleep(0.5)
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == proc.pid
        torchrun = psutil.Process(holder["torchrun_pid"])
        run = [torchrun, *torchrun.children(recursive=True)]
        assert len(torchrun.children()) == 2, run  # the ranks
        torchrun.suspend()
        proc.kill()
        proc.wait(timeout=60)
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {proc.pid} \(its torchrun: pid {torchrun.pid}\)"):
            check_not_in_use(cfg)
        torchrun.resume()  # the SIGTERM its launcher's death sent is delivered now
        _, alive = psutil.wait_procs(run, timeout=300)
        assert not alive, alive
    check_not_in_use(cfg)  # the lock is stale now: the next run takes it over
