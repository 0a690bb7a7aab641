"""Helpers for tests that run the real `megatron-async train` (vLLM replica + megatron learner)."""
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
# A run of ~40 s on 2 cores: tiny model (vLLM's CPU attention needs head_dim >= 32), short SFT.
SMALL = [
    "model.tiny_hidden_size=64", "model.tiny_heads=2", "model.tiny_kv_heads=2", "model.tiny_layers=2",
    "sft.steps=40", "sft.batch_size=16", f"trainer.steps={STEPS}", "trainer.checkpoint_every=2",
    "trainer.micro_batch_size=8", "rollout.prompts_per_step=8", "rollout.k=4", "rollout.max_new_tokens=48",
    "rollout.temperature=1.0", "data.eval_size=8", "rollout.kv_cache_gib=0.25",
]
# RLOO trains on every batch; Online DPO skips prompts whose K rewards tie, which for a barely
# trained tiny model is most of them.
RLOO = ["trainer.algorithm=rloo", "trainer.warmup_steps=0"]
PPO = ["trainer.algorithm=ppo", "trainer.warmup_steps=0"]  # trains on every batch too; adds a value model


def train(out_dir, *overrides, resume=False, env=None, check=True) -> subprocess.CompletedProcess:
    """Run `megatron-async train` in its own session; afterwards kill whatever it left behind.

    NOTE: a learner killed with SIGKILL (fault tests) leaves multiprocessing helpers of
    dist_checkpointing orphaned, holding inherited pipes: output goes to files, not pipes, and the
    session's process group is killed once the learner has exited.
    """
    cmd = [sys.executable, "-m", "megatron_async", "train", str(REPO / "configs" / "cpu_tiny.yaml"),
           *SMALL, f"run.out_dir={out_dir}", *overrides] + (["--resume"] if resume else [])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            code = proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, code, out.read(), err.read())
    if check and code != 0:
        pytest.fail(f"train exited {code}:\n{(result.stdout + result.stderr)[-8000:]}")
    return result


def metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from the run's embedded MLflow store."""
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
            for key in client.get_run(run_id).data.metrics}
