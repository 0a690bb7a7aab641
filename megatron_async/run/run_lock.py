"""One run per run folder: the process that owns a run holds `<run dir>/run.lock` for its lifetime.

    lock = RunLock.take(cfg)      # ConfigError naming the run that holds the folder
    ...
    lock.release()                # on every exit path that runs code

The lock file is JSON naming the holder: host, pid, start time and command line. It is created
with O_EXCL (atomic, on a shared filesystem too), and removed by `release` only while it is still
this process's.

Who takes it (run/launch.py): one process per run, the one that starts learner rank 0:
`megatron-async train` itself when it relaunches under torchrun (before torchrun starts), or else
learner rank 0 (a one-rank run; under a torchrun started by launch/*.sh, on whichever node holds
rank 0). The other ranks, and the ranks the command relaunches, never touch it. A relaunching
command names its torchrun in the lock (`name_torchrun`): should the command die first (SIGKILL),
the folder stays held until torchrun and its ranks have ended too (run/stop.py stops them then).

Stale locks: a lock written on this host whose pid runs no more, or runs a process started after
the lock was taken (a reused pid), and whose torchrun (if it names one) runs no more either, is
taken over with one warning line; so is one written by an earlier attempt of this SLURM job (a
requeued job keeps its SLURM_JOB_ID, and SLURM ends the earlier attempt's processes first), on any
host. Any other lock written on another host is never judged stale: whether its pid runs cannot
be seen from here, so it is refused naming that host, pid and the file to remove once that run is
known to be gone (docs/reliability.md).
Two launches that find the same stale lock take turns (an flock on the run folder while one
judges and replaces it), so only one of them takes it over; where the filesystem refuses an flock
on a folder (NFS), that rare race is not guarded (the O_EXCL create still is).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from megatron_async.config import Config, ConfigError
from megatron_async.io_utils import atomic_write_text

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


@dataclass(frozen=True)
class LockHolder:
    """What the lock file says about the process that holds the run folder."""
    host: str
    pid: int
    started: float  # time.time() when the lock was taken
    command: str
    slurm_job: str = ""  # "<SLURM_JOB_ID>:<SLURM_RESTART_COUNT>" under SLURM, else ""
    torchrun_pid: int = 0  # the torchrun this process started (0: none)
    torchrun_started: float = 0.0  # that process's start time (psutil's create_time)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))
        job = f", SLURM job {self.slurm_job.replace(':', ' attempt ')}" if self.slurm_job else ""
        torchrun = f" (its torchrun: pid {self.torchrun_pid})" if self.torchrun_pid else ""
        return f"pid {self.pid}{torchrun} on {self.host}{job}, started {when}: {self.command}"

    def is_gone(self) -> bool:
        """On this host only (the caller checks): its pid runs no more, or runs a later process
        (a reused pid), and so does its torchrun's, if it names one."""
        try:
            holder_gone = psutil.Process(self.pid).create_time() > self.started + 1.0
        except psutil.NoSuchProcess:
            holder_gone = True
        if not (holder_gone and self.torchrun_pid):
            return holder_gone
        try:
            return abs(psutil.Process(self.torchrun_pid).create_time() - self.torchrun_started) > 1.0
        except psutil.NoSuchProcess:
            return True

    def is_earlier_attempt_of(self, slurm_job: str) -> bool:
        """Taken by an earlier attempt of the SLURM job `slurm_job` (this process's): SLURM ends
        every process of a job before it requeues it, so that attempt is gone, on whatever host."""
        if not (self.slurm_job and slurm_job):
            return False
        (held_id, held_attempt), (job_id, attempt) = self.slurm_job.split(":"), slurm_job.split(":")
        return held_id == job_id and int(held_attempt) < int(attempt)


def slurm_job() -> str:
    """This process's SLURM job and attempt ("<SLURM_JOB_ID>:<SLURM_RESTART_COUNT>"; "" outside SLURM)."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    return f"{job_id}:{os.environ.get('SLURM_RESTART_COUNT') or 0}" if job_id else ""


def read_holder(run_dir: Path) -> LockHolder | None:
    """The holder named by run_dir's lock file (None: no lock file, or one cut short by a crash
    while it was written, which names no process)."""
    try:
        return LockHolder(**json.loads((run_dir / LOCK_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # not JSON, or other fields: a write cut short
        return None


def refusal(cfg: Config, holder: LockHolder) -> str | None:
    """Why `cfg`'s run may not start while `holder` holds its folder (None: the holder is gone)."""
    here, path = socket.gethostname(), cfg.run_dir / LOCK_FILE
    if holder.is_earlier_attempt_of(slurm_job()):
        return None
    if holder.host != here:
        return (f"key 'run.name' = {cfg.run.name!r}: run folder {cfg.run_dir} is in use by another run "
                f"({holder.describe()}); it was taken on another host than this one ({here}), so whether that "
                f"run still runs cannot be checked from here: wait for it, or, once it is known to be gone, "
                f"remove {path}; or choose another run.name")
    if holder.is_gone():
        return None
    return (f"key 'run.name' = {cfg.run.name!r}: run folder {cfg.run_dir} is in use by another run "
            f"({holder.describe()}); wait for it to finish or stop it, or choose another run.name")


def check_not_in_use(cfg: Config) -> None:
    """Raise ConfigError if another run holds `cfg`'s run folder (the preflight's check; `take`
    checks again, atomically)."""
    holder = read_holder(cfg.run_dir)
    if holder is not None and (why := refusal(cfg, holder)):
        raise ConfigError(why)


@dataclass
class RunLock:
    """This process's hold on a run folder."""
    path: Path
    holder: LockHolder

    @classmethod
    def take(cls, cfg: Config) -> "RunLock":
        """Take `cfg`'s run folder (creating it), taking over a stale lock with one warning line;
        ConfigError if another run holds it."""
        run_dir = cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        me = LockHolder(socket.gethostname(), os.getpid(), time.time(), shlex.join(["megatron-async", *sys.argv[1:]]),
                        slurm_job())
        path = run_dir / LOCK_FILE
        folder = os.open(run_dir, os.O_RDONLY)
        try:
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)  # one judge of a stale lock at a time
            except OSError:  # NFS locks need a file open for writing, not a folder: unguarded there
                pass
            try:
                _create(path, me)
            except FileExistsError:
                holder = read_holder(run_dir)
                if holder is not None and (why := refusal(cfg, holder)):
                    raise ConfigError(why) from None
                gone = holder.describe() if holder is not None else "its file names no process"
                log.warning("run folder %s: taking over the lock of a run that is gone (%s)", run_dir, gone)
                path.unlink()
                _create(path, me)
        finally:
            os.close(folder)  # releases the flock
        log.info("run folder %s taken by this run (%s; %s)", run_dir, me.describe(), path)
        return cls(path, me)

    def name_torchrun(self, pid: int) -> None:
        """Name the torchrun this process has started (`pid`) in the lock file: the folder stays
        held while it runs, should this process die before it."""
        holder = replace(self.holder, torchrun_pid=pid, torchrun_started=psutil.Process(pid).create_time())
        atomic_write_text(self.path, json.dumps(asdict(holder)))
        self.holder = holder

    def release(self) -> None:
        """Remove the lock file if it is still this process's (idempotent)."""
        if read_holder(self.path.parent) == self.holder:
            self.path.unlink(missing_ok=True)


def _create(path: Path, holder: LockHolder) -> None:
    """Write the lock file; FileExistsError if there is one (O_EXCL: atomic)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(holder)))
