"""rollout.weight_transport=gloo with a pipeline-parallel megatron learner: every stage's sender
streams over its own group into a real vLLM CPU replica (`mas_gloo`, which holds the stages' groups
side by side; weights/broadcast.py), through the trainer's own `WeightUpdate`.

Runs tests/dist/broadcast_pp_worker.py under torchrun: after a sync vLLM's logprobs equal
transformers' on the pushed checkpoint and the learner's own after an Adam step (the shm tests'
tolerance, 1e-3); a load that raises inside the last stage's bucket publishes nowhere, stops the
update with WeightSyncError on every rank, and the next push to that replica (its groups formed
anew) serves the learner's weights.
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker
from tests.rollout_fixtures import LOGPROB_TOL

pytestmark = pytest.mark.integration  # torchrun workers with a vLLM replica


def check_rounds(rows: list[dict]) -> None:
    assert [r["round"] for r in rows] == ["full", "stepped", "raising", "resynced"], rows
    full, stepped, raising, resynced = rows
    assert full["hf_diff"] < LOGPROB_TOL, f"vLLM vs transformers after the first sync: {full['hf_diff']}"
    for r in (full, stepped, resynced):
        assert r["error"] is None and r["record_versions"] == [r["version"]], r
        assert r["learner_diff"] < LOGPROB_TOL, f"round {r['round']}: vLLM vs learner logprobs differ by {r}"
    assert raising["error"] and "reached no replica" in raising["error"], raising
    assert raising["needing_weights"] == [0], raising


def test_a_pp2_learner_syncs_over_gloo_stage_by_stage_groups(tiny_models, tmp_path):
    run_worker("broadcast_pp_worker.py", tmp_path, tiny_models[0], tiny_models[1], 1, 2, nproc=2, timeout=400)
    check_rounds(json.loads((tmp_path / "rounds.json").read_text()))
