"""`launch/gpu_check.sh --dry-run` on CPU: every phase of the GPU device check runs its code path at
tiny sizes, as on the lent GPU machine (mlflow, vLLM, TE and other packages hidden by
tests/hide_modules), and says ok or skipped with a reason. Keeps the script from rotting between
GPU runs; ~40-60 s on a quiet 2-core machine. Also the GPU tests' worker modes that do not need
CUDA (checkpoint round trip, HF export) on CPU.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.dist import REPO, run_worker

pytestmark = pytest.mark.integration  # starts the script and its phase processes (tests/conftest.py tiers)

PHASES = ("env", "fork_probe", "gpu_tests", "learner_bench", "weights_bench", "batch_prep", "vllm", "te")


def test_dry_run_walks_every_phase(tmp_path):
    out = tmp_path / "gpu_check"
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=800)
    tail = (proc.stdout + proc.stderr)[-4000:]
    results = {p: json.loads((out / f"{p}.json").read_text()) for p in PHASES if (out / f"{p}.json").exists()}
    assert set(results) == set(PHASES), f"phases without JSON: {set(PHASES) - set(results)}\n{tail}"
    for phase, r in results.items():
        assert r["status"] in ("ok", "skipped"), f"{phase}: {r.get('error')}\n{r.get('traceback', '')}\n{tail}"
        if r["status"] == "skipped":
            assert r.get("reason"), f"{phase} skipped without a reason"
    assert proc.returncode == 0, tail
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["phases"]) == set(PHASES)

    env = results["env"]
    assert env["importable"]["mlflow"] is False and env["importable"]["vllm"] is False  # as on the GPU machine
    assert env["importable"]["megatron.core"] is True
    # the GPU tests were collected without mlflow/vLLM and skipped for want of CUDA, none failed
    gpu = results["gpu_tests"]
    assert gpu["failed"] == 0 and gpu["errors"] == 0 and gpu["passed"] == 0 and gpu["collection_errors"] == []
    assert any(t["test"].startswith("tests.test_gpu_learner::") for t in gpu["tests"])
    assert all(t["outcome"] == "skipped" for t in gpu["tests"])
    # the probes ran in fresh interpreters and reported what vLLM would decide
    assert results["fork_probe"]["default"]["vllm_would_use"] in ("fork", "spawn")
    learner = results["learner_bench"]
    assert learner["parameters"] > 0 and learner["tokens_per_s"] > 0 and learner["skipped"] == 0
    assert learner["versus_docs_scaling"]["grad_bytes_per_param"]["measured"] == pytest.approx(4.0, rel=0.01)
    assert results["weights_bench"]["round_trip_equal"]
    for algo in ("rloo", "ppo"):
        assert results["batch_prep"][algo]["tensors_off_device"] == []
        assert "advantages" in results["batch_prep"][algo]["keys"]
    assert results["vllm"]["status"] == "skipped" and "vLLM" in results["vllm"]["reason"]
    assert results["te"]["status"] == "skipped" and "Transformer Engine" in results["te"]["reason"]


@pytest.mark.parametrize("mode", ["checkpoint", "export"])
def test_gpu_worker_modes_run_on_cpu(tiny_ckpts, tmp_path, mode):
    """tests/dist/gpu_worker.py's checkpoint and export modes (run on CUDA by tests/test_gpu_learner.py)
    on CPU: fp32, the plain optimizer, gloo."""
    out = tmp_path / f"{mode}.json"
    run_worker("gpu_worker.py", mode, out, tiny_ckpts["gqa"])
    r = json.loads(out.read_text())
    assert r["backend"] == "gloo"
    if mode == "checkpoint":
        assert r["extra"] == {"step": 1} and r["same_names"] and r["lr_resumed"] == r["lr_saved_run"]
        assert r["loss_resumed"] == r["loss_saved_run"] and r["weight_max_diff"] == 0.0
    else:
        assert r["names_match"] and r["weights_equal_source_in_model_dtype"] and r["tokenizer_copied"]
        assert r["config_dtype"] == "float32" and r["logit_max_diff"] < 1e-4
