"""Megatron learner -> weight sync -> vLLM: after every sync, vLLM's logprobs of its sampled tokens
equal the learner's logprobs of the same tokens (fp32, max |diff| < 1e-3).

Runs tests/dist/sync_parity_worker.py under torchrun on 2 ranks (gloo), with the learner at TP=1
(x DP=2), TP=2 and PP=2, and an Adam step between syncs so the weights really change. Syncs
alternate between the shared-memory and the inline-HTTP carrier, each a vLLM weight update. Models:
GQA LLaMA, tied embeddings, llama3 RoPE scaling, Qwen2 (q/k/v biases). In bf16 (model.dtype:
bfloat16, a bf16 learner with fp32 main weights and bf16 replicas, the GPU's pair) on the GQA model:
the learner pushes bf16 and the replica's logprobs stay within bf16's error of the learner's, far
below what one step moves them.
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker
from tests.rollout_fixtures import build_variants

pytestmark = pytest.mark.integration  # torchrun workers with vLLM replicas

MODELS = ("gqa", "tied", "llama3", "qwen2")
BF16_TOL = 0.05  # max |diff| of bf16 logprobs, vLLM vs the bf16 learner (measured 0.003-0.009, 2026-12-04)
BF16_STEP_OVER_TOL = 5  # one lr=1e-2 Adam step moves them by more than this x BF16_TOL (measured 0.65-1.72)


def test_vllm_logprobs_match_the_megatron_learner_after_every_sync(tmp_path):
    models = build_variants(tmp_path / "models")
    run_worker("sync_parity_worker.py", tmp_path, *(models[m] for m in MODELS), nproc=2, timeout=480)
    rows = json.loads((tmp_path / "parity.json").read_text())
    assert [(r["model"], r["tp"], r["pp"], r["round"]) for r in rows] == [
        (m, tp, pp, rnd) for m in MODELS for tp, pp in [(1, 1), (2, 1), (1, 2)] for rnd in range(3)
    ]
    assert [r["transport"] for r in rows[:3]] == ["shm", "http", "shm"]
    for r in rows:
        where = f"{r['model']} tp={r['tp']} pp={r['pp']} round {r['round']}"
        assert r["max_diff"] < 1e-3, f"{where} over {r['transport']}: vLLM vs learner logprobs differ by {r['max_diff']}"
        assert r["record_versions"] == [r["version"]] and r["records"] == 8, where
        assert r["published"] == 1, f"{where}: {r['published']} replicas published the version"
        if r["round"]:
            assert r["moved"] > 1e-2, f"{where}: the optimizer step did not change the policy ({r['moved']})"


def test_a_bf16_learner_syncs_bf16_weights_to_bf16_replicas(tmp_path):
    models = build_variants(tmp_path / "models")
    run_worker("sync_parity_worker.py", tmp_path, models["gqa"], "--dtype", "bfloat16", nproc=2, timeout=480)
    rows = json.loads((tmp_path / "parity.json").read_text())
    assert [(r["tp"], r["pp"], r["round"]) for r in rows] == [(tp, pp, rnd) for tp, pp in [(1, 1), (2, 1), (1, 2)]
                                                              for rnd in range(3)]
    for r in rows:
        where = f"tp={r['tp']} pp={r['pp']} round {r['round']} over {r['transport']}"
        assert r["pushed_dtypes"] == ["torch.bfloat16"], where  # rank 0 is a source at every layout
        assert r["published"] == 1 and r["record_versions"] == [r["version"]], where
        assert r["max_diff"] < BF16_TOL, f"{where}: vLLM vs learner logprobs differ by {r['max_diff']}"
        if r["round"]:  # a stale replica would be off by what the step moved
            assert r["moved"] > BF16_STEP_OVER_TOL * BF16_TOL, f"{where}: the step moved the policy by {r['moved']}"

