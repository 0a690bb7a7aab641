"""ReplicaPool with real vLLM replicas: records, dispatch, auth, faults, shutdown.

The fault test SIGKILLs a replica in the middle of a generate call and checks that no prompt is
lost, that the replica is restarted, that it serves nothing before the current weights were
pushed to it, and that a replica failing more than `max_failures` times stops the pool loudly.

The module shares one 2-replica pool; the `pool` fixture hands it over healthy (a replica an earlier
test killed is restarted and given the current weights), so every test passes alone or in any
order. Tests that kill a replica kill it themselves; the one that exhausts the failure budget and
stops the pool has a pool of its own.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from megatron_async.rollout import PoolError, ReplicaClient, ReplicaPool, Sampling
from megatron_async.weights.sync import WeightSender, WeightSyncError
from tests.rollout_fixtures import LOGPROB_TOL, max_logprob_diff, spec, state_dict

PROMPTS = [[1, 5 + i, 6, 7 + 2 * i][: 2 + i % 3] for i in range(12)]
STOP_IDS = tuple(range(100, 130))


@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def shared_pool(models, tmp_path_factory):
    with ReplicaPool(spec(models[0]), 2, log_dir=tmp_path_factory.mktemp("logs"), request_timeout_s=120) as p:
        p.held = models[0]  # the checkpoint every replica holds; a test that pushes other weights sets it
        yield p


@pytest.fixture
def pool(shared_pool):
    """The module's pool with both replicas up and on the same version of `pool.held`."""
    statuses = shared_pool.health_check()  # restarts a replica that an earlier test killed
    version = max(s["version"] for s in statuses)
    behind = [a for a, s in zip(shared_pool.addresses, statuses) if s["version"] != version or not s["weights_ok"]]
    if behind:
        push(behind, shared_pool.authkey, version, shared_pool.held)
    return shared_pool


def current_version(pool) -> int:
    versions = {s["version"] for s in pool.health_check()}
    assert len(versions) == 1, versions
    return versions.pop()


def push(addresses, authkey, version, model_dir=None, named=None, **kw):
    named = iter(state_dict(model_dir).items()) if named is None else named
    with WeightSender(addresses, authkey, timeout_s=kw.pop("timeout_s", 30), bucket_bytes=1 << 20, **kw) as s:
        return s.push(version, 0, 1, named)


def wait_for(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def dead(proc: psutil.Process) -> bool:
    """Exited (a zombie until the pool reaps it, or gone)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_non_loopback_host_requires_an_explicit_token(tmp_path):
    with pytest.raises(ValueError, match="without an explicit authkey"):  # refused before anything starts
        ReplicaPool(spec(tmp_path), 1, host="0.0.0.0")


@pytest.mark.integration
def test_wrong_authkey_is_rejected(pool):
    client = ReplicaClient(pool.addresses[0], b"not-the-token", timeout_s=5)
    with pytest.raises(ConnectionError, match="authentication failed"):
        client.call("health")
    assert ReplicaClient(pool.addresses[0], pool.authkey, timeout_s=5).call("health")["ok"]


@pytest.mark.integration
def test_generate_returns_well_formed_versioned_records(pool):
    version = current_version(pool)
    sampling = Sampling(n=2, max_tokens=12, temperature=1.0, stop_token_ids=STOP_IDS, seed=3)
    records = pool.generate(PROMPTS, sampling, chunk_size=1)
    assert [(r.prompt_index, r.sample_index) for r in records] == [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    for r in records:
        assert r.prompt_token_ids == tuple(PROMPTS[r.prompt_index])
        assert r.policy_version == version and r.replica_id in (0, 1)
        assert 1 <= len(r.token_ids) <= 12 and len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 0.0 for lp in r.logprobs)
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in STOP_IDS and not set(r.token_ids[:-1]) & set(STOP_IDS)
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 12 and not set(r.token_ids) & set(STOP_IDS)
    assert {r.finish_reason for r in records} == {"stop", "length"}
    assert {r.replica_id for r in records} == {0, 1}
    assert len({r.token_ids for r in records}) > len(records) // 2  # distinct random streams per completion
    assert max_logprob_diff(pool.held, records) < LOGPROB_TOL
    # per-completion seeds: the same call gives the same samples, whichever replica serves a prompt
    assert [r.token_ids for r in pool.generate(PROMPTS, sampling, chunk_size=1)] == [r.token_ids for r in records]


@pytest.mark.integration
def test_killed_replica_loses_no_prompt_and_rejoins_only_with_current_weights(pool, models):
    """Replica 0 is held busy by an open weight update (it stays healthy but serves nothing), so
    after replica 1 is SIGKILLed the queue can only drain through the restarted replica 1, and
    only once the current weights (version v) were pushed to it."""
    v, restarts = current_version(pool) + 1, pool.stats()["restarts"]
    push(pool.addresses, pool.authkey, v, models[1])
    pool.held = models[1]
    chunks = lambda: pool.stats()["chunks_per_replica"][1]  # noqa: E731
    base, old_pid = chunks(), pool.pids()[1]
    prompts = [[1, 3 + i, 4] for i in range(32)]
    result, held = {}, {}
    gen = threading.Thread(target=lambda: result.update(r=pool.generate(prompts, Sampling(n=2, max_tokens=32, ignore_eos=True, seed=0), chunk_size=2)))
    gen.start()
    wait_for(lambda: chunks() > base, 60, "replica 1 to take work")

    gate = threading.Event()

    def held_weights():  # re-push version v to replica 0, pausing after update_begin
        items = list(state_dict(models[1]).items())
        yield from items[:3]
        gate.wait(120)
        yield from items[3:]

    holder = threading.Thread(target=lambda: held.update(m=push([pool.addresses[0]], pool.authkey, v, named=held_weights())))
    holder.start()
    probe = ReplicaClient(pool.addresses[0], pool.authkey, timeout_s=10)
    wait_for(lambda: probe.call("health")["updating"] == v, 60, "replica 0 to hold generation")

    os.kill(old_pid, signal.SIGKILL)
    wait_for(lambda: [(r.replica_id, r.version) for r in pool.replicas_needing_weights()] == [(1, 0)], 240, "the restarted replica")
    stale_chunks = chunks()
    time.sleep(1.0)
    assert chunks() == stale_chunks and gen.is_alive()  # up, but stale: given no work
    push([pool.addresses[1]], pool.authkey, v, models[1])  # the learner's resync
    wait_for(lambda: chunks() > stale_chunks, 120, "the resynced replica to rejoin")
    gate.set()
    holder.join(60)
    gen.join(300)
    assert held["m"]["completed"] == 1
    records = result["r"]
    assert sorted((r.prompt_index, r.sample_index) for r in records) == [(i, j) for i in range(len(prompts)) for j in range(2)]
    assert all(len(r.token_ids) == 32 for r in records)
    assert {r.policy_version for r in records} == {v}
    stats = pool.stats()
    assert stats["requeues"] >= 1 and stats["restarts"] == restarts + 1 and pool.pids()[1] != old_pid
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=8, seed=1), chunk_size=1)
    assert {r.replica_id for r in records} == {0, 1} and {r.policy_version for r in records} == {v}
    assert max_logprob_diff(models[1], records) < LOGPROB_TOL


@pytest.mark.integration
def test_killed_replica_fails_a_strict_sync_and_is_reported_by_a_lenient_one(pool, models):
    v = current_version(pool) + 1
    victim = psutil.Process(pool.pids()[0])
    victim.kill()
    wait_for(lambda: dead(victim), 10, "the replica to die")
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"version {v} .*replica at 127\.0\.0\.1:{pool.addresses[0][1]}"):
        push(pool.addresses, pool.authkey, v, models[0], timeout_s=5)
    assert time.monotonic() - t0 < 20
    metrics = push(pool.addresses, pool.authkey, v, models[0], timeout_s=5, strict=False)
    pool.held = models[0]  # on replica 1; the `pool` fixture restarts replica 0 and resyncs it
    assert metrics["replicas"] == 1 and list(metrics["failed"]) == [f"replica at 127.0.0.1:{pool.addresses[0][1]}"]


@pytest.mark.integration
def test_replica_failing_past_max_failures_stops_the_pool_then_stop_leaves_no_process(models, tmp_path):
    # a pool of its own: max_failures=1 allows replica 0 one restart, not two, and the pool stops
    with ReplicaPool(spec(models[0]), 1, log_dir=tmp_path, request_timeout_s=120, max_failures=1) as pool:
        first = psutil.Process(pool.pids()[0])
        first.kill()
        wait_for(lambda: dead(first), 10, "the replica to die")
        pool.health_check()  # restarts replica 0: its first failure
        assert pool.stats()["restarts"] == 1 and pool.pids()[0] != first.pid
        os.kill(pool.pids()[0], signal.SIGKILL)
        with pytest.raises(PoolError, match=r"replica 0 failed 2 times \(max_failures=1\)"):
            pool.generate(PROMPTS, Sampling(max_tokens=4), timeout_s=120)
        procs = [psutil.Process(p) for p in pool.pids() if psutil.pid_exists(p)]
        pool.stop()
    psutil.wait_procs(procs, timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)


@pytest.mark.integration
def test_replicas_exit_when_the_pool_process_is_killed(models, tmp_path):
    script = textwrap.dedent(f"""
        import time
        from megatron_async.rollout import ReplicaPool
        from tests.rollout_fixtures import spec
        if __name__ == "__main__":
            pool = ReplicaPool(spec({str(models[0])!r}), 1, log_dir={str(tmp_path)!r}).start()
            print(pool.pids()[0], flush=True)
            time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        replica_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(replica_pid)
    finally:
        parent.kill()
        parent.wait()
    gone, alive = psutil.wait_procs([psutil.Process(replica_pid)] if psutil.pid_exists(replica_pid) else [], timeout=15)
    assert not alive
