"""GPU-only learner checks: Transformer Engine layer spec, bf16 with fp32 master weights, NCCL.

Skipped without CUDA. Run on a GPU machine with `pytest -m gpu tests/test_gpu_learner.py`.
"""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from tests.dist import run_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (TE spec, bf16, NCCL)"),
]


def test_te_spec_fp32_and_bf16_logits_match_transformers(tiny_ckpts, tmp_path):
    run_worker("gpu_worker.py", "parity", tmp_path / "out.json", tiny_ckpts["gqa"])
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["backend"] == "nccl"
    if importlib.util.find_spec("transformer_engine") is not None:
        assert r["float32_qkv_module"].startswith("TE"), r["float32_qkv_module"]
    # TE names its fused norms differently; the HF names must come out the same.
    assert r["float32_names"] == r["bfloat16_names"]
    assert r["float32_max_diff"] < 1e-3  # GPU kernels (no TF32) vs transformers, fp32
    assert r["bfloat16_max_diff"] < 0.05 * max(1.0, r["logit_scale"])


def test_bf16_training_with_distributed_optimizer(tiny_ckpts, tmp_path):
    run_worker("gpu_worker.py", "train", tmp_path / "out.json", tiny_ckpts["gqa"])
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["dtype"] == "torch.bfloat16"
    assert r["optimizer"] == "DistributedOptimizer"
    assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"])
    assert r["losses"][-1] < r["losses"][0]  # same batch four times: the loss must fall


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for TP=2 over NCCL")
def test_nccl_tp2_training_matches_tp1(tiny_ckpts, tmp_path):
    run_worker("gpu_worker.py", "train", tmp_path / "tp1.json", tiny_ckpts["gqa"])
    run_worker("gpu_worker.py", "train", tmp_path / "tp2.json", tiny_ckpts["gqa"], "--tp", 2, nproc=2)
    tp1 = json.loads((tmp_path / "tp1.json").read_text())
    tp2 = json.loads((tmp_path / "tp2.json").read_text())
    assert tp2["backend"] == "nccl"
    for a, b in zip(tp1["losses"], tp2["losses"]):
        assert b == pytest.approx(a, rel=2e-2)  # bf16
