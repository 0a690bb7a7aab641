"""`launch/gpu_check.sh --dry-run` on CPU: every phase of the GPU device check runs its code path at
tiny sizes, as on the lent GPU machine (mlflow, vLLM, TE and other packages hidden by
tests/hide_modules), and says ok or skipped with a reason. Keeps the script from rotting between
GPU runs; ~40-60 s on a quiet 2-core machine. Also the GPU tests' worker modes that do not need
CUDA (checkpoint round trip, HF export) on CPU.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import textwrap

import pytest

from tests.dist import REPO, run_worker

pytestmark = pytest.mark.integration  # starts the script and its phase processes (tests/conftest.py tiers)

PHASES = ("env", "fork_probe", "gpu_tests", "learner_bench", "weights_bench", "weight_wire", "batch_prep", "vllm", "te")


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
    toolchain = env["compile_toolchain"]  # this machine has a compiler and Python.h: the CPU smoke compiles
    assert toolchain["cc"] and toolchain["python_h"] and toolchain["smoke_ok"], toolchain
    # the GPU tests were collected without mlflow/vLLM and skipped for want of CUDA, none failed
    gpu = results["gpu_tests"]
    assert gpu["failed"] == 0 and gpu["errors"] == 0 and gpu["passed"] == 0 and gpu["collection_errors"] == []
    assert any(t["test"].startswith("tests/test_gpu_learner.py::") for t in gpu["tests"])
    assert all(t["outcome"] == "skipped" for t in gpu["tests"]) and gpu["unfinished"] == []
    assert gpu["selected"] == len(gpu["tests"]) and "rerun_without_torch_compile" not in gpu
    # the probes ran in fresh interpreters and reported what vLLM would decide
    assert results["fork_probe"]["default"]["vllm_would_use"] in ("fork", "spawn")
    learner = results["learner_bench"]
    assert learner["parameters"] > 0 and learner["tokens_per_s"] > 0 and learner["skipped"] == 0
    assert learner["versus_docs_scaling"]["grad_bytes_per_param"]["measured"] == pytest.approx(4.0, rel=0.01)
    assert results["weights_bench"]["round_trip_equal"]
    assert results["weight_wire"]["shm_equal"] and results["weight_wire"]["gloo_equal"], results["weight_wire"]
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


def _gpu_check_module():
    loaded = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_gpu_tests_cut_short_keep_what_finished(tmp_path):
    """The gpu_tests phase's pytest run, killed by its budget in the middle of a test, still
    reports the tests that ended before (per-test report, tools/gpu_check_report.py) and names the
    unfinished one; a test failing in setup counts as an error."""
    tests = tmp_path / "test_cut.py"
    tests.write_text(textwrap.dedent("""
        import threading
        import pytest

        pytestmark = pytest.mark.gpu

        @pytest.fixture
        def broken():
            raise RuntimeError("setup broke")

        def test_a_passes():
            pass

        def test_b_fails():
            assert 1 == 2

        def test_c_skips():
            pytest.skip("no CUDA here")

        def test_d_errors(broken):
            pass

        def test_e_hangs():
            threading.Event().wait()  # until the budget kills pytest
    """))
    out = _gpu_check_module()._pytest_gpu([str(tests)], tmp_path / "report.jsonl", 30.0, {})
    outcomes = {t["test"].split("::")[1]: t["outcome"] for t in out["tests"]}
    assert out["rc"] is None and "pytest killed after 30 s" in out["cut_short"], out["pytest_tail"]
    assert outcomes == {"test_a_passes": "passed", "test_b_fails": "failed", "test_c_skips": "skipped",
                        "test_d_errors": "error"}, out
    assert out["selected"] == 5 and [u.split("::")[1] for u in out["unfinished"]] == ["test_e_hangs"], out
    assert (out["passed"], out["failed"], out["errors"], out["skipped"]) == (1, 1, 1, 1)
