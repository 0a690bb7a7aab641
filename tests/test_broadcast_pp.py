"""rollout.weight_transport=gloo with a TP=2 x PP=2 megatron learner (4 ranks under torchrun): every
stage's sender streams over its own group into a real vLLM CPU replica (`mas_gloo`, which holds the
stages' groups side by side; weights/broadcast.py), through the trainer's own `WeightUpdate`.

One torchrun launch and one replica start (tests/dist/broadcast_pp_worker.py) cover: logprob parity
after a sync with transformers on the pushed checkpoint and with the learner after an Adam step (the
shm tests' tolerance, 1e-3); a load that raises inside the last stage's bucket (publishes nowhere,
WeightSyncError on every rank, the re-sync that follows serves); the replica killed inside a bucket
of stage 1 (publishes nowhere, no error, bounded by the sender's timeout; restarted by the pool, the
re-sync serves); the replica restarted between pushes (the regular push leaves it out, the re-sync
forms its groups anew and serves). The PP=2 (TP=1) test this replaces checked a subset of these
rounds on 2 ranks.
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker
from tests.dist.broadcast_pp_worker import KILL_AT, SYNC_TIMEOUT_S
from tests.rollout_fixtures import LOGPROB_TOL

pytestmark = pytest.mark.integration  # torchrun workers with a vLLM replica

TP, PP = 2, 2


def check_rounds(out: dict) -> None:
    assert [(p["round"], p["version"]) for p in out["pushes"]] == [
        ("full", 1), ("stepped", 2), ("raising", 3), ("raising", 3), ("killed", 4), ("killed", 4),
        ("restarted", 5), ("restarted", 5)], out["pushes"]
    full, stepped, raising, resynced, killed, killed_resync, restarted, restarted_resync = out["pushes"]
    for p in (full, stepped, resynced, killed_resync, restarted_resync):  # every stage reached the replica
        assert p["error"] is None and p["opened"] == [0] and p["published"] == [0], p
        assert [s["stage"] for s in p["senders"]] == list(range(PP)) and not any(s["failed"] for s in p["senders"]), p
    assert raising["error"] and "reached no replica" in raising["error"], raising
    assert raising["needing_weights"] == [0], raising
    # killed inside a bucket of stage 1: dropped there, nothing published, no stop, bounded wait
    assert killed["error"] is None and killed["opened"] == [0] and killed["published"] == [], killed
    last = killed["senders"][-1]
    assert last["stage"] == PP - 1 and last["failed"] and last["buckets"] > KILL_AT, killed  # drained the rest
    assert killed["seconds"] < SYNC_TIMEOUT_S + 30, killed
    # restarted between pushes: the regular push leaves it out (its groups are its dead predecessor's)
    assert restarted["error"] is None and restarted["opened"] == [] and restarted["published"] == [], restarted

    assert [r["round"] for r in out["rounds"]] == ["full", "stepped", "raising", "killed", "restarted"], out["rounds"]
    full_round = out["rounds"][0]
    assert full_round["hf_diff"] < LOGPROB_TOL, f"vLLM vs transformers after the first sync: {full_round['hf_diff']}"
    for r in out["rounds"]:
        assert r["record_versions"] == [r["version"]] and r["needing_weights"] == [], r
        assert r["learner_diff"] < LOGPROB_TOL, f"round {r['round']}: vLLM vs learner logprobs differ by {r}"


def test_a_tp2_pp2_learner_syncs_over_gloo_and_survives_a_raising_load_a_kill_and_a_restart(tiny_models, tmp_path):
    run_worker("broadcast_pp_worker.py", tmp_path, tiny_models[0], tiny_models[1], TP, PP, nproc=TP * PP, timeout=900)
    check_rounds(json.loads((tmp_path / "rounds.json").read_text()))
