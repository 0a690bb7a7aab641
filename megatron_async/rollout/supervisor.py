"""Supervisor of one replica server: `python supervisor.py PARENT_PID [--cpus=0,2] -- CMD...` (run by path).

Runs CMD (vLLM's API server) in this session's process group and ends the whole group (server,
engine core, workers) when CMD exits, when SIGTERM arrives, or when PARENT_PID is no longer this
process's parent (the learner that started it died: vLLM has no parent-death handling of its own).
With `--cpus`, it first pins itself to those CPU ids, so that CMD and every process CMD starts
inherit them (rollout.replica_cpus). SIGUSR1 is ignored here and in CMD (the disposition is
inherited across exec): it is the learner's "save and stop" warning (run/stop.py), which SLURM
sends to every process of a job step, and a replica must keep serving until the learner closes it.

Standard library only, and started by path rather than `-m`, so that it imports nothing of the
package (no torch): it costs a few MB per replica, not a few hundred.
"""
import os
import signal
import subprocess
import sys
import time


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    sep = sys.argv.index("--")
    parent, options, cmd = int(sys.argv[1]), sys.argv[2:sep], sys.argv[sep + 1:]
    for option in options:
        if not option.startswith("--cpus="):
            sys.exit(f"supervisor: unknown option {option!r} (expected --cpus=ID,ID,...)")
        os.sched_setaffinity(0, [int(c) for c in option.removeprefix("--cpus=").split(",")])
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.Popen(cmd)

    def end_group(code: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal_group(0, signal.SIGTERM)  # the server shuts its engine down cleanly on SIGTERM
        deadline = time.monotonic() + 10.0
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_group(0, signal.SIGKILL)  # ends this process too
        os._exit(code)

    signal.signal(signal.SIGTERM, lambda *_: end_group(143))
    while True:
        if (code := child.poll()) is not None:
            end_group(code)
        if os.getppid() != parent:
            end_group(3)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
