"""`launch/gpu_check.sh --dry-run` on CPU: every phase of the GPU device check runs its code path at
tiny sizes, as on the lent GPU machine (mlflow, vLLM, TE and other packages hidden by
tests/hide_modules), and says ok or skipped with a reason; what it hands back is one archive and
one summary file (tools/gpu_check_pack.py). Keeps the script from rotting between GPU runs; ~40-60 s
on a quiet 2-core machine. Also the GPU tests' worker modes that do not need CUDA (checkpoint round
trip, HF export) on CPU, and the packing alone (no process).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tarfile
import textwrap

import pytest

from tests.dist import REPO, run_worker

PHASES = ("env", "fork_probe", "gpu_tests", "learner_bench", "weights_bench", "weight_wire", "batch_prep", "vllm", "te")


def _tool(name: str):
    loaded = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert loaded is not None and loaded.loader is not None, name
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


@pytest.mark.integration  # starts the script and its phase processes (tests/conftest.py tiers)
def test_dry_run_walks_every_phase(tmp_path):
    out, work = tmp_path / "gpu_check", tmp_path / "work"
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=800, env={**os.environ, "GPU_CHECK_WORK": str(work)})
    tail = (proc.stdout + proc.stderr)[-4000:]
    # handed back: exactly one archive and one summary (the lent machine returns at most 8 files)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"], tail
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    unpacked = tmp_path / "unpacked" / "gpu_check"
    packed = sorted(str(p.relative_to(unpacked)) for p in unpacked.rglob("*") if p.is_file())
    assert packed == sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()), tail  # all of it
    assert len(packed) > 8 and "gpu_tests.jsonl" in packed and "exit_codes.txt" in packed, packed
    results = {p: json.loads((unpacked / f"{p}.json").read_text()) for p in PHASES if (unpacked / f"{p}.json").exists()}
    assert set(results) == set(PHASES), f"phases without JSON: {set(PHASES) - set(results)}\n{tail}"
    for phase, r in results.items():
        assert r["status"] in ("ok", "skipped"), f"{phase}: {r.get('error')}\n{r.get('traceback', '')}\n{tail}"
        if r["status"] == "skipped":
            assert r.get("reason"), f"{phase} skipped without a reason"
    assert proc.returncode == 0, tail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and set(summary["phases"]) == set(PHASES)
    assert {p: s["status"] for p, s in summary["phases"].items()} == {p: r["status"] for p, r in results.items()}
    assert all(s["exit_code"] == 0 for s in summary["phases"].values()), summary
    assert summary["archive_members"] == [f"gpu_check/{m}" for m in sorted(packed)]

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


def test_each_pack_hands_back_one_archive_and_one_summary_of_what_ended(tmp_path):
    """tools/gpu_check_pack.py as gpu_check.sh calls it after each phase: OUT holds exactly the
    archive of every file under WORK (folders too) and the summary, replaced as phases end; a phase
    without its JSON yet is "pending", an unreadable one "failed", exit codes from exit_codes.txt."""
    pack = _tool("gpu_check_pack").pack
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "learner_bench").mkdir(parents=True)
    (work / "env.json").write_text(json.dumps({"phase": "env", "status": "ok", "seconds": 3.5}))
    (work / "install.log").write_text("installed 1 wheel\n")
    (work / "exit_codes.txt").write_text("env 0\n")
    first = pack(work, out, seconds=4)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"]
    assert first["phases"]["env"] == {"status": "ok", "seconds": 3.5, "exit_code": 0}
    assert first["phases"]["gpu_tests"] == {"status": "pending"} and not first["complete"]

    (work / "gpu_tests.json").write_text(json.dumps({"phase": "gpu_tests", "status": "failed", "error": "2 failed"}))
    (work / "gpu_tests.jsonl").write_text('{"selected": []}\n')
    (work / "learner_bench" / "learner.json").write_text("{}")
    (work / "fork_probe.json").write_text("{cut")
    (work / "exit_codes.txt").write_text("env 0\nfork_probe 137\ngpu_tests 1\n")
    second = pack(work, out, seconds=90)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"]
    assert json.loads((out / "summary.json").read_text()) == second
    assert second["seconds"] == 90 and second["phases"]["gpu_tests"] == {"status": "failed", "error": "2 failed",
                                                                           "exit_code": 1}
    assert second["phases"]["fork_probe"]["status"] == "failed" and second["phases"]["fork_probe"]["exit_code"] == 137
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert sorted(tar.getnames()) == second["archive_members"] == [
            "gpu_check/env.json", "gpu_check/exit_codes.txt", "gpu_check/fork_probe.json", "gpu_check/gpu_tests.json",
            "gpu_check/gpu_tests.jsonl", "gpu_check/install.log", "gpu_check/learner_bench/learner.json"]
        member = tar.extractfile("gpu_check/gpu_tests.json")
        assert member is not None and member.read() == (work / "gpu_tests.json").read_bytes()


def test_the_summary_states_the_reach_of_each_claim_of_the_gpu_section(tmp_path):
    """summary.json's "reach", from fake phase results of a one-GPU run without vLLM: a claim whose
    phase or test passed is "exercised here", one that failed is exercised with its failure, one
    skipped is "not exercisable on this machine" with the skip's reason, one the machine cannot run
    at all says why, one whose phase has not ended is "not reached"; a dry run exercises nothing."""
    gpu_check, pack = _tool("gpu_check"), _tool("gpu_check_pack")
    work = tmp_path / "work"
    work.mkdir()

    def phase(name, **result):
        (work / f"{name}.json").write_text(json.dumps({"phase": name, "dry_run": False, "seconds": 1.0, **result}))

    tests = "tests/test_gpu_learner.py::"
    phase("gpu_tests", status="failed", error="1 GPU tests failed", tests=[
        {"test": tests + "test_bf16_training_with_distributed_optimizer", "outcome": "passed"},
        {"test": tests + "test_hf_export_from_cuda", "outcome": "failed", "detail": "AssertionError: x"},
        {"test": tests + "test_nccl_tp2_training_matches_tp1", "outcome": "skipped", "detail": "needs 2 GPUs"}])
    phase("learner_bench", status="ok")
    phase("vllm", status="skipped", reason="vLLM is not installed")
    phase("batch_prep", status="failed", error="rloo: tensors off cuda")
    by_claim = {c["claim"]: c for c in pack.summarize(work, seconds=5)["reach"]}
    assert list(by_claim) == [c.claim for c in gpu_check.CLAIMS]  # every claim, in the docs' order
    assert all(c["reach"] in ("exercised here", "not exercisable on this machine", "not reached") for c in by_claim.values())

    assert by_claim["bf16 training with megatron's DistributedOptimizer"] == {
        "claim": "bf16 training with megatron's DistributedOptimizer", "by": tests + "test_bf16_training_with_distributed_optimizer",
        "reach": "exercised here", "result": "passed"}
    assert by_claim["HF export from CUDA tensors"]["result"] == "failed" and "AssertionError" in by_claim["HF export from CUDA tensors"]["why"]
    assert by_claim["TP=2 over NCCL trains like TP=1"]["reach"] == "not exercisable on this machine"
    assert by_claim["TP=2 over NCCL trains like TP=1"]["why"] == "needs 2 GPUs"
    nccl = by_claim["the NCCL weight sync into a GPU vLLM replica (mas_nccl)"]  # its module is not collected without vLLM
    assert nccl["reach"] == "not exercisable on this machine" and "not collected" in nccl["why"]
    learner = by_claim["learner step time, tokens/s, MFU and memory per component against docs/scaling.md"]
    assert learner["reach"] == "exercised here" and learner["result"] == "passed"
    assert by_claim["vLLM generation on the GPU"] == {"claim": "vLLM generation on the GPU", "by": "phase vllm",
                                                      "reach": "not exercisable on this machine", "why": "vLLM is not installed"}
    batch = [c for name, c in by_claim.items() if name.startswith("RLOO / PPO batch preparation")][0]
    assert batch["result"] == "failed" and batch["why"] == "rloo: tensors off cuda"
    assert by_claim["weight packing and checksums of GPU tensors"]["reach"] == "not reached"  # its phase never ended
    beyond = [c for c in gpu_check.CLAIMS if c.beyond]
    assert {c.claim for c in beyond} >= {name for name in by_claim if name.startswith(("pipeline parallelism", "SIGTERM"))}
    assert all(by_claim[c.claim] == {"claim": c.claim, "reach": "not exercisable on this machine", "why": c.beyond}
               for c in beyond)

    phase("learner_bench", status="ok", dry_run=True)  # a dry run on CPU: the code path, not a GPU
    dry = {c["claim"]: c for c in pack.summarize(work, seconds=6)["reach"]}[learner["claim"]]
    assert dry["reach"] == "not exercisable on this machine" and dry["why"].startswith("dry run")


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["checkpoint", "export", "main_weights"])
def test_gpu_worker_modes_run_on_cpu(tiny_ckpts, tmp_path, mode):
    """tests/dist/gpu_worker.py's checkpoint, export and main_weights modes (run on CUDA by
    tests/test_gpu_learner.py) on CPU: the plain optimizer (main_weights: its bf16 form, megatron's
    Float16OptimizerWithFloat16Params), fp32 otherwise, gloo."""
    out = tmp_path / f"{mode}.json"
    run_worker("gpu_worker.py", mode, out, tiny_ckpts["gqa"])
    r = json.loads(out.read_text())
    assert r["backend"] == "gloo"
    if mode == "checkpoint":
        assert r["extra"] == {"step": 1} and r["same_names"] and r["lr_resumed"] == r["lr_saved_run"]
        assert r["loss_resumed"] == r["loss_saved_run"] and r["weight_max_diff"] == 0.0
    elif mode == "export":
        assert r["names_match"] and r["weights_equal_source_in_model_dtype"] and r["tokenizer_copied"]
        assert r["config_dtype"] == "float32" and r["logit_max_diff"] < 1e-4
    else:
        assert r["optimizer"] == "Float16OptimizerWithFloat16Params" and not r["sharded"]
        assert r["set"] == r["main_params"] > 0 and r["not_bf16_exact"] > 0 and r["main_equal_checkpoint"]


@pytest.mark.integration
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
    out = _tool("gpu_check")._pytest_gpu([str(tests)], tmp_path / "report.jsonl", 30.0, {})
    outcomes = {t["test"].split("::")[1]: t["outcome"] for t in out["tests"]}
    assert out["rc"] is None and "pytest killed after 30 s" in out["cut_short"], out["pytest_tail"]
    assert outcomes == {"test_a_passes": "passed", "test_b_fails": "failed", "test_c_skips": "skipped",
                        "test_d_errors": "error"}, out
    assert out["selected"] == 5 and [u.split("::")[1] for u in out["unfinished"]] == ["test_e_hangs"], out
    assert (out["passed"], out["failed"], out["errors"], out["skipped"]) == (1, 1, 1, 1)
