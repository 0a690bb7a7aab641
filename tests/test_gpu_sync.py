"""GPU-only: weight sync over NCCL (weights/nccl.py) from this process's GPU 0 to a vLLM replica on GPU 1.

Skipped without 2 CUDA devices (NCCL takes one GPU per rank). Has not run yet: no session so far
had a GPU. Run with `pytest -m gpu tests/test_gpu_sync.py` (launch/gpu_check.sh runs it too).
After every NCCL sync the replica's logprobs must equal transformers' on the pushed weights
(fp32), and a bad checksum must fail the sync without hanging.

Tolerance: on CPU vLLM and transformers agree to ~5e-7 in fp32 (LOGPROB_TOL 1e-3). On a GPU vLLM's
fp32 attention runs in Triton kernels whose fp32 dot products use TF32 (tl.dot's default input
precision), which no torch switch turns off, while the transformers reference runs in IEEE fp32 on
the CPU; GPU_LOGPROB_TOL = 1e-2 is TF32-sized (10-bit mantissa; bf16's 7 bits would need ~5e-2).
Needs vLLM (skipped without it, as on the lent GPU machine).
"""
from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from megatron_async.rollout import ReplicaPool, Sampling
from megatron_async.weights import sync as sync_mod
from megatron_async.weights.sync import WeightSender, WeightSyncError
from tests.rollout_fixtures import build_models, max_logprob_diff, spec, state_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,  # vLLM replica processes (tests/conftest.py tiers)
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (learner GPU 0, replica GPU 1)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
GPU_LOGPROB_TOL = 1e-2  # TF32 in vLLM's GPU attention (module docstring); CPU: LOGPROB_TOL
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43], [1, 100]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def pool(models, tmp_path_factory):
    with ReplicaPool(spec(models[0]), 1, log_dir=tmp_path_factory.mktemp("logs"), devices=["1"],
                     request_timeout_s=120) as p:
        yield p


def on_gpu(model_dir):
    return iter([(n, t.cuda()) for n, t in state_dict(model_dir).items()])


def check(pool, model_dir, version):
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, seed=version))
    assert {r.policy_version for r in records} == {version}
    assert max_logprob_diff(model_dir, records) < GPU_LOGPROB_TOL


def test_nccl_sync_matches_transformers_over_several_versions(pool, models):
    torch.cuda.set_device(0)
    with WeightSender(pool.addresses, pool.authkey, timeout_s=60, bucket_bytes=64 << 10, transport="nccl") as sender:
        for version, model_dir in [(1, models[1]), (2, models[2])]:  # the second reuses the group
            m = sender.push(version, 0, 1, on_gpu(model_dir))
            assert m["transports"] == ["nccl"] and m["completed"] == 1 and m["buckets"] > 3
            check(pool, model_dir, version)


def test_nccl_bad_checksum_fails_without_hanging_then_recovers(pool, models, monkeypatch):
    torch.cuda.set_device(0)
    real = sync_mod.device_checksum
    monkeypatch.setattr(sync_mod, "device_checksum", lambda buf: real(buf) ^ 1)
    t0 = time.monotonic()
    with WeightSender(pool.addresses, pool.authkey, timeout_s=30, bucket_bytes=64 << 10, transport="nccl") as sender:
        with pytest.raises(WeightSyncError, match="version 3.*nccl.*checksum mismatch"):
            sender.push(3, 0, 1, on_gpu(models[0]))
        assert time.monotonic() - t0 < 60
        monkeypatch.undo()
        sender.push(3, 0, 1, on_gpu(models[0]))  # a new group is formed after the failure
    check(pool, models[0], 3)
