"""Weight sync: buckets, shared memory and carriers (no process), then real vLLM replicas updated in
place through vLLM's weight-transfer API and our `mas_cpu` engine.

After every sync vLLM's sampled-token logprobs must equal transformers' logprobs of the same tokens
under the pushed weights (fp32, max |diff| < 1e-3). A sync here is what learner rank 0 and one
stage sender do (tests/rollout_fixtures.sync): `begin_update`, `HostMemorySender.push`,
`finish_update` on the replicas the push reached.

The real-vLLM tests share one 2-replica pool; each pushes the next version after the pool's
current one and leaves every replica fresh (the `pool` fixture re-syncs one an earlier failing
test left behind), so every test passes alone or after any other. The architecture variants
(tied embeddings, Qwen2 with q/k/v biases) need replicas started from their own checkpoints:
one 1-replica pool each (`slow`).
"""
from __future__ import annotations

import collections
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import load as st_load

from megatron_async.rollout import ReplicaClient, ReplicaPool, Sampling
from megatron_async.weights import host_memory as sync_mod
from megatron_async.weights.host_memory import (
    SAMPLE_BYTES, SAMPLE_STRIDE, SHM_DIR, BucketChecksumError, HostMemorySender, ShmSegment, carrier_for, checksum,
    iter_buckets, open_segment, pack_bucket, unpack_bucket,
)
from megatron_async.weights.update import WeightUpdate, group_by_cap
from tests.rollout_fixtures import (
    LOGPROB_TOL, SMALL_BUCKET, TrackedPool, build_variants, max_logprob_diff, perturbed, resync, sparsely_changed, spec,
    state_dict, sync,
)

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43], [1, 100], [1, 7, 7, 7, 7, 7], [1, 200, 3], [1, 12], [1, 60, 61]]
MID_LAYER_BUCKET = 8  # with SMALL_BUCKET: q_proj of layer 0, after its k_proj (bucket 6), before its v_proj


def own_segments() -> list[str]:
    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"mas-wsync-{os.getpid()}-")]


# -- pure logic -----------------------------------------------------------------------------------
def test_group_by_cap_respects_cap_order_and_oversize():
    ts = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 100, 5, 5])]
    groups = list(group_by_cap(ts, cap_bytes=160))  # 40 floats
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    for g in groups:
        size = sum(t.nbytes for _, t in g)
        assert size <= 160 or len(g) == 1  # only a lone tensor may exceed the cap
    with pytest.raises(ValueError):
        list(group_by_cap(ts, 0))


def test_iter_buckets_consumes_lazily():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield f"w{i}", torch.full((16,), float(i))  # 64 bytes each

    it = iter_buckets(gen(), cap_bytes=128)
    first = next(it)
    assert first.names == ("w0", "w1") and pulled == [0, 1, 2]  # one tensor of look-ahead only
    assert sum(len(b.names) for b in it) == 8


def test_bucket_roundtrip_and_checksum():
    tensors = [("a.weight", torch.randn(3, 4)), ("b.weight", torch.randn(5).to(torch.bfloat16)),
               ("c", torch.arange(3, dtype=torch.int8)), ("d", torch.randn(4, 2).t()), ("e", torch.zeros(0, 3))]
    bucket = pack_bucket(0, tensors)
    out = unpack_bucket(bytes(bucket.payload), bucket.checksum)
    assert bucket.names == ("a.weight", "b.weight", "c", "d", "e") and set(out) == set(bucket.names)
    assert all(torch.equal(out[n], t) and out[n].dtype == t.dtype for n, t in tensors)
    assert all(torch.equal(v, out[n]) for n, v in st_load(bytes(bucket.payload)).items())  # a real safetensors file
    corrupt = bytearray(bucket.payload)
    corrupt[-1] ^= 0xFF
    with pytest.raises(BucketChecksumError, match="checksum mismatch"):
        unpack_bucket(bytes(corrupt), bucket.checksum)
    with pytest.raises(ValueError, match="duplicate tensor names"):
        pack_bucket(1, [("a", torch.ones(1)), ("a", torch.ones(1))])


def test_sampled_checksum_covers_header_length_and_sampled_pages_only():
    """The sampled scope's guarantee, as weights/host_memory.py states it: the length, the whole header
    and the sampled 4 KiB pages are checked, any other byte is not."""
    tensors = [(f"layer{i}.weight", torch.randn(256, 1024)) for i in range(4)]  # 4 MiB of data
    offset = 3 * SAMPLE_BYTES
    bucket = pack_bucket(0, tensors, sample_offset=offset)
    payload = bytes(bucket.payload)
    assert bucket.sample_offset == offset and bucket.checksum == checksum(payload, offset) != checksum(payload)
    assert set(unpack_bucket(payload, bucket.checksum, offset)) == {n for n, _ in tensors}
    (head_len,) = struct.unpack_from("<Q", payload)
    data_start = 8 + head_len
    sampled = data_start + offset + 10 * SAMPLE_STRIDE + 100  # inside a sampled page
    unsampled = sampled + SAMPLE_BYTES  # just after it
    for where, caught in [(20, True), (sampled, True), (len(payload) - 1, True), (unsampled, False)]:
        corrupt = bytearray(payload)
        corrupt[where] ^= 0xFF
        assert (checksum(corrupt, offset) != bucket.checksum) == caught, where
    assert checksum(payload[:-8], offset) != bucket.checksum  # truncated
    assert checksum(payload, offset + SAMPLE_BYTES) != bucket.checksum  # another scope
    with pytest.raises(BucketChecksumError, match="sampled from"):
        unpack_bucket(payload[:20] + b"x" + payload[21:], bucket.checksum, offset)


def test_shm_segment_is_private_reused_grown_and_removed():
    seg = ShmSegment(initial_bytes=64)
    bucket = pack_bucket(0, [("w", torch.arange(8.0))], seg.buffer)
    path = seg.path
    assert path is not None
    assert os.stat(path).st_mode & 0o777 == 0o600  # owner only
    assert torch.equal(unpack_bucket(memoryview(open_segment(path))[: len(bucket.payload)], bucket.checksum)["w"], torch.arange(8.0))
    pack_bucket(1, [("w", torch.ones(4))], seg.buffer)
    assert seg.path == path  # reused
    pack_bucket(2, [("w", torch.ones(2 << 20))], seg.buffer)  # 8 MB > 64 B + header slack
    assert seg.path != path and not os.path.exists(path)  # grown into a new file, the old one removed
    seg.close()
    assert not own_segments()
    with pytest.raises(FileNotFoundError, match="not found"):
        open_segment(path)
    with pytest.raises(ValueError, match="refusing"):
        open_segment("/etc/passwd")


def test_carrier_choice(monkeypatch):
    assert carrier_for("auto", "http://127.0.0.1:8000") == "shm" and carrier_for("auto", "http://localhost:1") == "shm"
    assert carrier_for("auto", "http://10.0.0.7:8000") == "http" and carrier_for("http", "http://127.0.0.1:8000") == "http"
    with pytest.raises(ValueError, match="weight_transport=shm needs replicas on this host"):
        carrier_for("shm", "http://10.0.0.7:8000")
    with pytest.raises(ValueError, match="nccl is weights/broadcast.BroadcastSender"):
        carrier_for("nccl", "http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="rollout.weight_transport='udp'"):
        carrier_for("udp", "http://127.0.0.1:8000")
    monkeypatch.setattr(sync_mod, "shm_free_bytes", lambda: 64 << 20)  # a container's default /dev/shm
    with HostMemorySender(["http://127.0.0.1:1"], "k", bucket_bytes=64 << 20) as sender:
        assert sender.carriers == ["http"]  # auto falls back; nothing is sent before push
    with HostMemorySender(["http://127.0.0.1:1"], "k", bucket_bytes=16 << 20) as sender:
        assert sender.carriers == ["shm"]
    with HostMemorySender(["http://127.0.0.1:1", "http://10.0.0.7:2"], "k", bucket_bytes=16 << 20) as sender:
        assert sender.carriers == ["http", "shm"]
    with pytest.raises(ValueError, match="at least one replica"):
        HostMemorySender([], "k")
    with pytest.raises(ValueError, match="key"):
        HostMemorySender(["http://127.0.0.1:1"], "")


# -- real vLLM (integration) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def shared_pool(models, tmp_path_factory):
    p = TrackedPool(spec(models[0]), 2, log_dir=tmp_path_factory.mktemp("logs"), request_timeout_s=120,
                   start_timeout_s=300)
    p.held = models[0]
    with p:
        yield p


@pytest.fixture
def pool(shared_pool):
    resync(shared_pool)
    yield shared_pool
    assert not own_segments()  # every sender unlinked its segments


def other(models, *not_these):
    return next(m for m in models if m not in not_these)


def sample_and_check(pool, model_dir, version, seed=0):
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, temperature=1.0, seed=seed))
    assert len(records) == 2 * len(PROMPTS)
    assert {(r.policy_version, r.policy_version_max) for r in records} == {(version, version)}
    assert max_logprob_diff(model_dir, records) < LOGPROB_TOL
    return records


@pytest.mark.integration
def test_sync_changes_outputs_and_logprobs_match_transformers(pool, models):
    greedy = Sampling(n=1, max_tokens=12, temperature=0.0)
    old = pool.held
    new = other(models, old)
    before = pool.generate(PROMPTS, greedy)
    assert max_logprob_diff(old, before) < LOGPROB_TOL
    version = pool.current_version + 1
    metrics, done = sync(pool, new, version)
    pool.held = new
    assert done == [0, 1] and metrics.carriers == ["shm"] and not metrics.failed
    assert metrics.buckets > 10 and metrics.replicas == 2
    assert metrics.bytes > sum(t.nbytes for t in state_dict(new).values()) and metrics.bytes_total == 2 * metrics.bytes
    assert metrics.gb_per_s > 0 and 0 < metrics.send_seconds <= metrics.seconds
    assert [(s["version"], s["weights_ok"]) for s in pool.health_check()] == [(version, True)] * 2
    after = pool.generate(PROMPTS, greedy)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert max_logprob_diff(new, after) < LOGPROB_TOL
    records = sample_and_check(pool, new, version)
    assert {r.replica_id for r in records} == {0, 1}  # both replicas received the update and served


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["shm", "http"])
def test_bad_checksum_drops_the_replica_from_the_push_and_leaves_it_stale(pool, models, monkeypatch, transport):
    """Replica 0 is told a wrong CRC32 for one bucket in the middle of a layer (q/k/v split over
    buckets): its `/update_weights` fails, the sender drops it for the rest of the push and reports
    it; replica 1 completes and publishes the version, replica 0 does not and serves nothing. The
    next full sync (other weights) then succeeds on both: the failed update left no half-loaded
    layer behind (weights/vllm_plugin.abort_reload)."""
    v = pool.current_version
    failed_model = other(models, pool.held)
    next_model = other(models, pool.held, failed_model)
    sent = {"count": 0}
    real_update = ReplicaClient.update_weights

    def corrupt_one(self, update_info):
        if self.url == pool.urls[0]:
            sent["count"] += 1
            if sent["count"] == MID_LAYER_BUCKET + 1:
                update_info = {**update_info, "checksum": update_info["checksum"] ^ 1}
        return real_update(self, update_info)

    monkeypatch.setattr(ReplicaClient, "update_weights", corrupt_one)
    metrics, done = sync(pool, failed_model, v + 1, transport=transport)
    monkeypatch.undo()
    assert list(metrics.failed) == [pool.urls[0]] and "checksum mismatch" in metrics.failed[pool.urls[0]]
    assert sent["count"] == MID_LAYER_BUCKET + 1  # no bucket went to replica 0 after the failed one
    assert metrics.replicas == 1 and metrics.carriers == [transport] and done == [1]
    pool.held = failed_model  # the current version's weights, on replica 1
    assert [s["version"] for s in pool.health_check()] == [v, v + 1]
    assert [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)] == [0]
    records = sample_and_check(pool, failed_model, v + 1)
    assert {r.replica_id for r in records} == {1}  # the stale replica serves nothing

    metrics, done = sync(pool, next_model, v + 2, transport=transport)
    assert done == [0, 1] and not metrics.failed
    pool.held = next_model
    records = sample_and_check(pool, next_model, v + 2, seed=1)
    assert {r.replica_id for r in records} == {0, 1}


@pytest.mark.integration
def test_missing_segment_fails_loudly(pool, models, monkeypatch):
    """A segment gone before the replicas map it: every replica fails that bucket, naming the path."""
    v = pool.current_version
    target = other(models, pool.held)

    def unlinked(named, cap, alloc, sample_offset):
        for b in iter_buckets(named, cap, alloc, sample_offset):
            if b.index == 2:
                for name in own_segments():  # the segment vanishes before any replica maps it
                    os.unlink(os.path.join(SHM_DIR, name))
            yield b

    monkeypatch.setattr(sync_mod, "iter_buckets", unlinked)
    metrics, done = sync(pool, target, v + 1, transport="shm")
    monkeypatch.undo()
    assert done == [] and metrics.replicas == 0 and sorted(metrics.failed) == sorted(pool.urls)
    for error in metrics.failed.values():
        assert "/dev/shm/mas-wsync-" in error and "not found" in error, error
    assert [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)] == [0, 1]
    with pytest.raises(TimeoutError, match="prompts unfinished"):  # no replica is fresh: nothing is served
        pool.generate(PROMPTS[:2], Sampling(max_tokens=4), timeout_s=3)
    metrics, done = sync(pool, target, v + 1)  # the learner's retry
    assert done == [0, 1]
    pool.held = target
    sample_and_check(pool, target, v + 1)


@pytest.mark.integration
def test_incomplete_update_is_not_published_and_the_next_full_sync_works(pool, models):
    """Every bucket arrives but half the weights were never sent (a pipeline stage missing): the
    engine's verify step refuses to publish, on both replicas; the update is closed there, so the
    next full sync starts and publishes normally."""
    v = pool.current_version
    target = other(models, pool.held)
    items = list(state_dict(target).items())
    metrics, done = sync(pool, None, v + 1, named=iter(items[: len(items) // 2]))
    assert not metrics.failed and metrics.replicas == 2 and done == []
    assert [(s["version"], s["weights_ok"]) for s in pool.health_check()] == [(v, False)] * 2
    assert [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)] == [0, 1]
    metrics, done = sync(pool, target, v + 1)
    assert done == [0, 1] and not metrics.failed
    pool.held = target
    sample_and_check(pool, target, v + 1)


@pytest.mark.integration
def test_a_kept_sender_samples_checksums_and_no_replica_reads_an_answered_bucket(pool, models, monkeypatch):
    """Three syncs through one sender, as the learner keeps it: the first push checks every byte,
    the next ones a sample. Every shm segment is zeroed as soon as both replicas answered its bucket
    (the sender may rewrite it from then on): the layers that buckets split (SMALL_BUCKET) still
    load the pushed weights, so no replica read a bucket after answering it (vllm_plugin.detach_buffered)."""
    answers: collections.Counter = collections.Counter()
    scopes: list = []
    lock = threading.Lock()
    real_update = ReplicaClient.update_weights

    def zero_once_answered(self, update_info):
        real_update(self, update_info)
        if "shm" not in update_info:  # the verify call
            return
        with lock:
            scopes.append(update_info["sample_offset"])
            key = (update_info["shm"], update_info["checksum"])
            answers[key] += 1
            if answers[key] == 2:
                with open(update_info["shm"], "r+b") as f:
                    f.write(bytes(update_info["size"]))

    monkeypatch.setattr(ReplicaClient, "update_weights", zero_once_answered)
    v = pool.current_version
    a = other(models, pool.held)
    b = other(models, a)
    with HostMemorySender(pool.urls, pool.key, timeout_s=60, bucket_bytes=SMALL_BUCKET, transport="shm") as sender:
        update = WeightUpdate.local(pool, sender, timeout_s=60)
        for step, model_dir in enumerate([a, b, a], start=1):
            scopes.clear()
            metrics, done = sync(pool, model_dir, v + step, update=update)
            assert done == [0, 1] and not metrics.failed and metrics.buckets > 10
            pool.held = model_dir
            sample_and_check(pool, model_dir, v + step, seed=step)
            if step == 1:
                assert scopes == [None] * len(scopes)  # the first push: every byte checked
            else:
                assert all(isinstance(o, int) for o in scopes) and len(set(scopes)) > 1


@pytest.mark.integration
def test_shm_and_http_carriers_give_identical_samples_and_logprobs(pool, models):
    v = pool.current_version
    a = other(models, pool.held)
    b = other(models, a)
    sampling = Sampling(n=2, max_tokens=12, seed=7)
    results = {}
    for step, (model_dir, transport) in enumerate([(a, "shm"), (b, "http"), (a, "http")], start=1):
        metrics, done = sync(pool, model_dir, v + step, transport=transport)
        assert done == [0, 1] and metrics.carriers == [transport]
        pool.held = model_dir
        records = pool.generate(PROMPTS, sampling)
        assert {r.policy_version for r in records} == {v + step}
        assert max_logprob_diff(model_dir, records) < LOGPROB_TOL
        results[(model_dir, transport)] = records
    # the same weights, whatever carried them: the same samples, the same logprobs (to float32
    # noise: vLLM may batch the requests differently from one call to the next)
    shm, http = results[(a, "shm")], results[(a, "http")]
    assert [r.token_ids for r in shm] == [r.token_ids for r in http]
    assert max(abs(x - y) for r, s in zip(shm, http) for x, y in zip(r.logprobs, s.logprobs)) < 1e-5
    assert [r.token_ids for r in results[(b, "http")]] != [r.token_ids for r in http]


@pytest.mark.integration
def test_delta_syncs_load_the_pushed_weights_and_a_replica_that_missed_one_gets_a_full_one(pool, models, tmp_path):
    """One sender and update with `full_every=3`, as `rollout.sync_full_every: 3` keeps them: versions that
    change 2% of the elements go as deltas between full pushes (a fraction of the bytes), and the
    replicas serve exactly the pushed weights after each; after a push that only replica 0 took,
    the next push is full (replica 1's kept base is a version behind)."""
    v = pool.current_version
    versions = [other(models, pool.held)]
    for seed in range(1, 6):
        versions.append(sparsely_changed(versions[-1], tmp_path / f"v{seed}", fraction=0.02, seed=seed))
    pushes = []
    with HostMemorySender(pool.urls, pool.key, timeout_s=60, bucket_bytes=SMALL_BUCKET, transport="shm") as sender:
        update = WeightUpdate.local(pool, sender, full_every=3, timeout_s=60)
        for step, (model_dir, ids) in enumerate(zip(versions, [None] * 4 + [[0], None]), start=1):
            metrics, done = sync(pool, model_dir, v + step, ids, update=update)
            assert done == (ids or [0, 1]) and not metrics.failed
            pushes.append(metrics)
            if ids is None:
                pool.held = model_dir
                sample_and_check(pool, model_dir, v + step, seed=step)
    assert [m.delta for m in pushes] == [False, True, True, False, True, False]
    assert all(m.bytes < pushes[0].bytes / 5 for m in pushes if m.delta)  # fp32: 8 bytes per changed element


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return build_variants(tmp_path_factory.mktemp("variants"))  # hidden 128: head_dim 32 for vLLM's CPU attention


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tied", "qwen2"])
def test_tied_embeddings_and_qwen2_biases_sync(variant, variants, tmp_path):
    """A replica of each architecture gets every weight changed (the tied model's one
    embedding/head matrix, Qwen2's q/k/v biases): logprobs follow the pushed weights."""
    ckpt = variants[variant]
    target = perturbed(ckpt, tmp_path / "target", seed=5)
    names = set(state_dict(target))
    if variant == "tied":
        assert "lm_head.weight" not in names  # one matrix: the head is the embedding
    else:
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"} <= names
    greedy = Sampling(n=1, max_tokens=12, temperature=0.0)
    with ReplicaPool(spec(ckpt), 1, log_dir=tmp_path / "logs", request_timeout_s=120, start_timeout_s=300) as pool:
        before = pool.generate(PROMPTS, greedy)
        assert max_logprob_diff(ckpt, before) < LOGPROB_TOL
        for version, (model_dir, transport) in enumerate([(target, "shm"), (ckpt, "http"), (target, "http")], start=1):
            metrics, done = sync(pool, model_dir, version, transport=transport)
            assert done == [0] and not metrics.failed, metrics
            records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, seed=version))
            assert {r.policy_version for r in records} == {version}
            assert max_logprob_diff(model_dir, records) < LOGPROB_TOL, (variant, version, transport)
        after = pool.generate(PROMPTS, greedy)
        assert [r.token_ids for r in after] != [r.token_ids for r in before]
        assert max_logprob_diff(target, after) < LOGPROB_TOL
