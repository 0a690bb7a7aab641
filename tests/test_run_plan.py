"""The run plan (megatron_async/run_plan.py) and the transports' table (megatron_async/transports.py)."""
import json
import subprocess
import sys

import pytest
import torch

from megatron_async import run_plan
from megatron_async.config import ConfigError, load_config
from megatron_async.learner.perf import Backend, resolve
from megatron_async.run_plan import PLAN_FILE, RunPlan, build_plan, load_plan, save_plan
from megatron_async.transports import TRANSPORTS, carrier_for
from megatron_async.weights.vllm_plugin import ENGINE_CLASSES


def test_the_tiny_cpu_run_plans_fp32_host_memory_full_syncs_and_is_saved_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    plan = build_plan(load_config(None, ["parallel.learner_cpus=", "rollout.replica_cpus="]))
    assert (plan.cuda, plan.model_dtype, plan.weight_transport, plan.weight_engine) == (False, "float32", "auto", "mas_cpu")
    assert (plan.sync_full_every, plan.sync_bucket_bytes, plan.learner_cpus, plan.replica_cpus) == (0, 64 << 20, "", "")
    line = plan.describe()
    assert "\n" not in line and line.startswith("run plan: cpu; float32 (auto: the built-in tiny model); weights over auto")
    assert load_plan(tmp_path) is None  # serve-replica before the learner has saved one
    save_plan(plan, tmp_path)
    assert load_plan(tmp_path) == plan and json.loads((tmp_path / PLAN_FILE).read_text())["model_dtype"] == "float32"


def test_a_gpu_machine_plans_bf16_over_nccl_with_vllms_packed_buffer_and_no_deltas():
    plan = build_plan(load_config(None, []), cuda=True)
    assert (plan.model_dtype, plan.weight_transport, plan.weight_engine) == ("bfloat16", "nccl", "mas_nccl")
    assert (plan.sync_full_every, plan.sync_bucket_bytes) == (0, 1024 << 20)
    # deltas asked for: host memory, whose carrier over http makes them pay for a bf16 replica
    plan = build_plan(load_config(None, ["rollout.sync_full_every=5"]), cuda=True)
    assert (plan.weight_transport, plan.sync_full_every) == ("auto", 5)


def test_the_learners_device_and_kernels_are_probed_once_by_the_plan_and_resolved_against(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert build_plan(load_config(None, [])).backend == Backend(cuda=False, te=False)  # this CPU machine
    gpu = Backend(cuda=True, te=True, grad_accum_kernel=True, softmax_kernel=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(run_plan, "learner_backend", lambda cuda: gpu if cuda else Backend(cuda=False, te=False))
    plan = build_plan(load_config(None, ["parallel.tp=2"]))
    assert plan.backend == gpu and plan.describe().startswith("run plan: cuda (TE spec, apex wgrad); bfloat16")
    save_plan(plan, tmp_path)
    assert load_plan(tmp_path) == plan  # what every rank and serve-replica read: rank 0's probe
    perf = resolve(None, plan.backend, tp=2, dp=2)  # what the learner builds with (learner/model.py)
    assert (perf.sequence_parallel, perf.rope_fusion, perf.gradient_accumulation_fusion) == (True, True, True)
    assert not resolve(None, plan.backend, tp=2, dp=2, tied_embeddings=True).gradient_accumulation_fusion
    # a plan for another machine (plan-sync's cuda=True) knows none of its kernels
    assert build_plan(load_config(None, []), cuda=True).backend == Backend(cuda=True, te=False)


def test_each_transport_rule_is_the_tables_and_the_checks_read_it():
    assert {name for name, t in TRANSPORTS.items() if not t.delta} == {"nccl"}
    with pytest.raises(ConfigError, match="delta sync is built for the host-memory transports and gloo, not "
                                          "rollout.weight_transport=nccl"):
        load_config(None, ["rollout.weight_transport=nccl", "rollout.sync_full_every=10"])
    assert {name for name, t in TRANSPORTS.items() if t.loopback_only} == {"shm"}
    with pytest.raises(ConfigError, match="shared memory needs the replicas on the learner's host"):
        load_config(None, ["rollout.weight_transport=shm", "rollout.host=10.0.0.1", "rollout.token=t"])
    with pytest.raises(ValueError, match="needs replicas on this host"):
        carrier_for("shm", "http://10.0.0.1:8000")
    # every engine the table names is one the replicas' vLLM plugin registers
    assert set(ENGINE_CLASSES) == {"auto", *(n for n, t in TRANSPORTS.items() if t.broadcast)}
    assert {t.engine for t in TRANSPORTS.values()} == {TRANSPORTS[n].engine for n in ENGINE_CLASSES}


@pytest.mark.integration  # one python process, a few seconds
def test_a_replicas_weight_engine_loads_neither_the_config_nor_the_algorithms():
    """The vLLM worker's side of the weight sync reads the transports' table only."""
    probe = ("import sys, megatron_async.weights.engines, megatron_async.weights.vllm_plugin; "
             "print(sorted(m for m in ('megatron_async.config', 'megatron_async.algorithms') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_plan_is_a_frozen_record():
    plan = build_plan(load_config(None, []), cuda=False)
    with pytest.raises(AttributeError):
        plan.model_dtype = "bfloat16"  # type: ignore[misc]
    assert isinstance(plan, RunPlan)
