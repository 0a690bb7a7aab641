"""Run checkpoints written in the background (trainer.async_save, run/checkpoint.py's
`RunCheckpoints` on megatron-core's `AsyncCallsQueue`), with real processes: two data-parallel
learner ranks under torchrun (tests/dist/async_save_worker.py).

- The learner steps while the save is written; the checkpoint holds the weights at the save, not
  the step's after it; `latest` names it only once it is complete; both DP ranks wrote shards
  (megatron's fully parallel save).
- Every rank SIGKILLed while checkpoint 2 is written: `latest` still names checkpoint 1, no
  step_000002 exists (at most its `.tmp`, never loaded), and checkpoint 1 loads with its weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_async.learner.parallel import free_port
from tests.dist import REPO, WORKERS, run_worker


@pytest.mark.integration  # torchrun workers
def test_a_background_save_holds_the_weights_at_the_save_and_becomes_latest_when_complete(tmp_path, tiny_ckpts):
    run_worker("async_save_worker.py", "complete", tmp_path, tiny_ckpts["gqa"], nproc=2)
    result = json.loads((tmp_path / "complete.json").read_text())
    assert result["latest_before"] is None and result["latest_after"] == "step_000001"
    assert result["second_step_changed_weights"] and result["loaded_the_weights_at_the_save"]
    shard_bytes = result["shard_bytes"]
    assert min(shard_bytes) >= sum(shard_bytes) / 4, shard_bytes  # the writing spread over both DP ranks


@pytest.mark.integration  # torchrun workers, SIGKILLed
def test_ranks_killed_during_a_background_save_leave_the_previous_checkpoint_loadable(tmp_path, tiny_ckpts):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    log = tmp_path / "killed.log"
    with open(log, "w") as out:  # a file, not a pipe: the orphaned writer processes hold what they inherited
        killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                 f"--master-port={free_port()}", str(WORKERS / "async_save_worker.py"), "killed",
                                 str(tmp_path), str(tiny_ckpts["gqa"])],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=240)
    assert killed.returncode != 0 and "Signal 9 (SIGKILL)" in log.read_text(), log.read_text()[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step_000001" and not (root / "step_000002").exists()
    run_worker("async_save_worker.py", "load", tmp_path, tiny_ckpts["gqa"])
    assert json.loads((tmp_path / "loaded.json").read_text()) == {"latest": "step_000001", "weights_as_saved": True}
