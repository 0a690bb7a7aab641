"""How replicas are launched (rollout/launcher.py, rollout/supervisor.py) and the shell logic of
launch/install.sh's Transformer Engine checks (launch/te_build.sh).

Fast tier: the replica environment and the supervisor's command line, built without starting
anything. Integration: the supervisor pinning what it runs, and te_build.sh's functions in bash.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_async.cluster.cpu_affinity import REPLICA_CPUS_ENV
from megatron_async.rollout.launcher import SUPERVISOR, LocalLauncher, replica_environment
from megatron_async.rollout.replica import ReplicaSpec, server_command
from tests.dist import REPO

LEARNER_ENV = {  # what launch/gpu_env.sh and torchrun give a learner rank, and the rest of an environment
    "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": "4",
    "NCCL_BUFFSIZE": "8388608", "RANK": "0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
    "NCCL_SOCKET_IFNAME": "^lo,docker", "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5", "NCCL_NET_GDR_LEVEL": "2",
    "NCCL_DEBUG": "WARN", "GLOO_SOCKET_IFNAME": "ib0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "8", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1",
}


def test_replicas_keep_the_learners_nccl_variables_but_not_its_own():
    """Both ends of the weight-sync communicator see the same NCCL_* (tuning included); torchrun's
    rendezvous and Megatron's CUDA_DEVICE_MAX_CONNECTIONS stay the learner's."""
    env = replica_environment(LEARNER_ENV)
    dropped = {"CUDA_DEVICE_MAX_CONNECTIONS", "RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    assert env == {k: v for k, v in LEARNER_ENV.items() if k not in dropped}
    assert {k for k in env if k.startswith("NCCL_")} == {k for k in LEARNER_ENV if k.startswith("NCCL_")}


def test_launcher_environment_and_supervisor_command(tmp_path, monkeypatch):
    """The pool's `env` is applied after the filter (it overrides what the replica inherits), then
    the server's own; rollout.replica_cpus becomes the supervisor's --cpus."""
    for k, v in LEARNER_ENV.items():
        monkeypatch.setenv(k, v)
    spec = ReplicaSpec(model="/m")
    launcher = LocalLauncher(spec, "127.0.0.1", "secret", tmp_path, 10.0, gpu=False,
                             env={"NCCL_ALGO": "Tree", REPLICA_CPUS_ENV: "1,3-4"}, devices=["2", "3"])
    env = launcher.environment(1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and "RANK" not in env
    assert env["NCCL_ALGO"] == "Tree" and env["NCCL_SOCKET_IFNAME"] == "^lo,docker" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["VLLM_API_KEY"] == "secret" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert launcher.command(env, 8011) == [sys.executable, str(SUPERVISOR), str(os.getpid()), "--cpus=1,3,4", "--",
                                           *server_command(spec, "127.0.0.1", 8011, False)]
    unpinned = launcher.command({k: v for k, v in env.items() if k != REPLICA_CPUS_ENV}, 8011)
    assert unpinned[3] == "--" and not any(a.startswith("--cpus") for a in unpinned)


@pytest.mark.integration
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to a strict subset")
def test_supervisor_pins_what_it_runs():
    """The supervisor pins itself before it starts CMD, so CMD (and what CMD starts) runs on those
    CPUs only; an unknown option is refused by name."""
    cpu = max(os.sched_getaffinity(0))
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    proc = subprocess.run([sys.executable, str(SUPERVISOR), str(os.getpid()), f"--cpus={cpu}", "--", sys.executable,
                           "-c", probe], capture_output=True, text=True, timeout=60, start_new_session=True)
    assert proc.stdout.strip() == str([cpu]), proc.stdout + proc.stderr
    bad = subprocess.run([sys.executable, str(SUPERVISOR), str(os.getpid()), "--cpu=0", "--", "true"],
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert bad.returncode != 0 and "unknown option '--cpu=0'" in bad.stderr


def te_build(call: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source launch/te_build.sh; {call}"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)


NVCC_12_8 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Feb_21_20:23:50_PST_2025
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0"""


@pytest.mark.integration
def test_te_build_checks_nvcc_against_torch():
    r = te_build(f"nvcc_cuda_version '{NVCC_12_8}'")
    assert r.stdout.strip() == "12.8", r.stderr
    assert te_build("check_te_toolkit 12.8 12.9").returncode == 0  # minor versions may differ (torch warns only)
    r = te_build("check_te_toolkit 12.8 13.0")
    assert r.returncode == 1 and "nvcc is CUDA 12.8 but the installed torch was built with CUDA 13.0" in r.stdout
    assert "install a CUDA 13 toolkit" in r.stdout and "WITH_TE=0" in r.stdout
    r = te_build("check_te_toolkit '' 13.0")
    assert r.returncode == 1 and "could not read the CUDA version" in r.stdout


@pytest.mark.integration
@pytest.mark.parametrize("nproc, mem_gib, jobs", [(16, 32, 8), (2, 64, 2), (4, 1, 1)])
def test_te_build_max_jobs(nproc, mem_gib, jobs):
    r = te_build(f"te_max_jobs {nproc} {mem_gib * 1024 * 1024}")
    assert r.stdout.strip() == str(jobs), r.stderr
