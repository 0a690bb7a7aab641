"""rollout.weight_transport=gloo with a TP=2 x PP=2 megatron learner (4 ranks under torchrun) and two
real vLLM CPU replicas on one host: every stage's sender streams over ONE group spanning both
replicas (a node group, weights/broadcast.py), the stages in turn, through the trainer's own
`WeightUpdate`; each replica holds the stages' groups side by side (`mas_gloo`).

One torchrun launch and one pool start (tests/dist/broadcast_pp_worker.py) cover issue 42 items 2
and 5: logprob parity after a sync with transformers on the pushed checkpoint and with the learner
after an Adam step (the shm tests' tolerance, 1e-3), on both replicas; a load that raises inside the
last stage's buffers (publishes nowhere, WeightSyncError on every rank, the re-sync that follows
serves); replica 1 killed inside a buffer of stage 1 (the node group fails whole: nothing
published, no error, bounded by the sender's timeout; replica 0, dropped only with its group, is
re-synced at once and serves while replica 1 restarts; the restarted replica 1 catches up); a
replica restarted between pushes (the regular push reaches the other, the re-sync it); and the
next regular push re-forming each stage's node group with both.
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker
from tests.dist.broadcast_pp_worker import KILL_AT, SYNC_TIMEOUT_S
from tests.rollout_fixtures import LOGPROB_TOL

pytestmark = pytest.mark.integration  # torchrun workers with vLLM replicas

TP, PP = 2, 2
BOTH = [0, 1]


def check_rounds(out: dict) -> None:
    assert out["stage_turns"] == PP  # the replicas share a host: node groups, so the stages go in turn
    assert [(p["round"], p["version"], p["opened"]) for p in out["pushes"]] == [
        ("full", 1, BOTH), ("stepped", 2, BOTH), ("raising", 3, BOTH), ("raising", 3, None), ("raising", 3, BOTH),
        ("killed", 4, BOTH),
        ("killed", 4, [0]), ("killed", 4, [1]), ("restarted", 5, [1]), ("restarted", 5, [0]),
        ("regrouped", 6, BOTH)], out["pushes"]
    (full, stepped, raising, raising_alone, resynced, killed, survivor, caught_up, restarted, restarted_resync,
     regrouped) = out["pushes"]
    for p in (full, stepped, resynced, survivor, caught_up, restarted, restarted_resync, regrouped):
        assert p["error"] is None and p["published"] == p["opened"], p
        assert [s["stage"] for s in p["senders"]] == list(range(PP)) and not any(s["failed"] for s in p["senders"]), p
    for p in (full, stepped, regrouped):  # one group per stage spans both replicas: the bytes cross once
        assert [s["groups"] for s in p["senders"]] == [[BOTH]] * PP, p
    # after a node group failed, its members go through groups of their own until a push reached them:
    # the raising load failed stage 1's only (stage 0's node group re-formed at the re-sync)
    assert [s["groups"] for s in resynced["senders"]] == [[BOTH], [[0], [1]]], resynced
    for p, alone in ((survivor, [[0]]), (caught_up, [[0], [1]])):  # replica 1 killed: re-synced one by one
        assert [s["groups"] for s in p["senders"]] == [alone] * PP, p
    # a raising load in a node group: nothing published, no stop; alone, each refuses: the run stops
    assert raising["error"] is None and raising["published"] == [] and raising["needing_weights"] == BOTH, raising
    assert raising["senders"][-1]["failed_with_group"] == raising["senders"][-1]["failed"] != [], raising
    assert raising_alone["error"] and "reached no replica" in raising_alone["error"], raising_alone
    # replica 1 killed inside a buffer of stage 1: its node group dropped whole, nothing published, no
    # stop (replica 0 was dropped only with its group), bounded wait; replica 0 re-synced first
    assert killed["error"] is None and killed["published"] == [], killed
    last = killed["senders"][-1]
    assert last["stage"] == PP - 1 and last["failed"] == last["failed_with_group"] and len(last["failed"]) == 2, killed
    assert last["buckets"] > KILL_AT and killed["seconds"] < SYNC_TIMEOUT_S + 30, killed  # drained the rest, bounded
    assert killed["needing_weights"] == [0], killed

    assert [r["round"] for r in out["rounds"]] == \
        ["full", "stepped", "raising", "survivor", "killed", "restarted", "regrouped"], out["rounds"]
    full_round = out["rounds"][0]
    assert full_round["hf_diff"] < LOGPROB_TOL, f"vLLM vs transformers after the first sync: {full_round['hf_diff']}"
    for r in out["rounds"]:
        survivor_round = r["round"] == "survivor"  # replica 1 restarting (or up, waiting for its re-sync)
        assert r["record_versions"] == [r["version"]] and r["needing_weights"] in ([], [1] if survivor_round else []), r
        assert r["record_replicas"] == ([0] if survivor_round else BOTH), r
        assert r["learner_diff"] < LOGPROB_TOL, f"round {r['round']}: vLLM vs learner logprobs differ by {r}"


def test_a_tp2_pp2_learner_syncs_two_replicas_through_node_groups_and_survives_a_kill_and_a_restart(tiny_models, tmp_path):
    run_worker("broadcast_pp_worker.py", tmp_path, tiny_models[0], tiny_models[1], TP, PP, nproc=TP * PP, timeout=900)
    check_rounds(json.loads((tmp_path / "rounds.json").read_text()))
