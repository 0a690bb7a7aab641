"""Worker scripts run by the learner/conversion tests (under torchrun when nproc > 1), and their launcher."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async.learner.parallel import free_port

WORKERS = Path(__file__).resolve().parent
REPO = WORKERS.parents[1]


def run_worker(script: str, *args, nproc: int = 1, timeout: int = 240) -> str:
    """Run tests/dist/<script> (under torchrun when nproc > 1); return its output, fail with its tail."""
    # prepend: packages installed with `pip install --target DIR` (the GPU check's offline wheels)
    # reach the workers through PYTHONPATH, which must not be replaced
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", str(WORKERS / script)]
    else:
        cmd = [sys.executable, str(WORKERS / script)]
    try:
        proc = subprocess.run([*cmd, *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output so far says where it stopped (bytes, even with text=True)
        so_far = b"".join(part if isinstance(part, bytes) else part.encode() for part in (e.stdout, e.stderr) if part)
        pytest.fail(f"{script} {' '.join(map(str, args))} (nproc={nproc}) still running after {timeout} s:\n"
                    f"{so_far.decode(errors='replace')[-6000:]}")
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(map(str, args))} (nproc={nproc}) exited {proc.returncode}:\n{out[-6000:]}")
    return out


