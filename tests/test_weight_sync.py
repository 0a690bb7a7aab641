"""Weight sync: bucketing and transports (pure), then real vLLM replicas updated in place from HF tensors.

After every sync, vLLM's sampled-token logprobs must equal transformers' logprobs of the same
tokens under the pushed weights (fp32, max |diff| < 1e-3), on every replica. The replicas are on
this host, so the default transport (auto) is shared memory; tests that name `socket` cover the
socket path on the same replicas.

The real-vLLM tests share one 2-replica pool. Each pushes the next version after the one the
replicas hold and leaves them healthy, so every test passes alone or after any other.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load as st_load

from megatron_async.rollout import ReplicaPool, Sampling
from megatron_async.rollout.worker_extension import fused_group
from megatron_async.weights import sync as sync_mod
from megatron_async.weights import nccl
from megatron_async.weights.buckets import (
    BucketChecksumError, device_checksum, group_by_cap, iter_buckets, pack_bucket, unpack_bucket,
)
from megatron_async.weights.shm import SHM_DIR, ShmSegment, open_segment
from megatron_async.weights.sync import WeightSender, WeightSyncError, transport_for
from tests.rollout_fixtures import LOGPROB_TOL, max_logprob_diff, spec, state_dict

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43], [1, 100], [1, 7, 7, 7, 7, 7], [1, 200, 3], [1, 12], [1, 60, 61]]
SMALL_BUCKET = 48 << 10  # splits q/k/v and gate/up of one layer over several buckets


# -- pure logic ---------------------------------------------------------------------------------
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


def test_shm_segment_is_private_reused_grown_and_removed():
    seg = ShmSegment(initial_bytes=64)
    bucket = pack_bucket(0, [("w", torch.arange(8.0))], seg.buffer)
    path = seg.path
    assert os.stat(path).st_mode & 0o777 == 0o600  # owner only
    assert torch.equal(unpack_bucket(memoryview(open_segment(path))[: len(bucket.payload)], bucket.checksum)["w"], torch.arange(8.0))
    pack_bucket(1, [("w", torch.ones(4))], seg.buffer)
    assert seg.path == path  # reused
    pack_bucket(2, [("w", torch.ones(2 << 20))], seg.buffer)  # 8 MB > 64 B + header slack
    assert seg.path != path and not os.path.exists(path)  # grown into a new file, the old one removed
    seg.close()
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"mas-wsync-{os.getpid()}-")]
    with pytest.raises(FileNotFoundError, match="not found"):
        open_segment(path)
    with pytest.raises(ValueError, match="refusing"):
        open_segment("/etc/passwd")


def test_transport_choice(monkeypatch):
    assert transport_for("auto", "127.0.0.1") == "shm" and transport_for("auto", "10.0.0.7") == "socket"
    monkeypatch.setattr(sync_mod, "shm_free_bytes", lambda: 64 << 20)  # a container's default /dev/shm
    with WeightSender([("127.0.0.1", 1)], b"k", bucket_bytes=64 << 20) as sender:
        assert sender.transports == ["socket"]  # auto falls back; it connects only when pushing
    with WeightSender([("127.0.0.1", 1)], b"k", bucket_bytes=16 << 20) as sender:
        assert sender.transports == ["shm"]
    assert transport_for("socket", "127.0.0.1") == "socket"
    with pytest.raises(ValueError, match="weight_transport=shm needs replicas on this host"):
        transport_for("shm", "10.0.0.7")
    with pytest.raises(ValueError, match="rollout.weight_transport='udp'"):
        transport_for("udp", "127.0.0.1")


def test_nccl_layout_roundtrip_and_device_checksum():
    """The NCCL transport's packing and checksum are plain torch: checked here on CPU."""
    tensors = [("q", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("i", torch.arange(3))]
    buf, layout = nccl.pack(tensors, torch.device("cpu"))
    assert all(lo % nccl.ALIGN == 0 for *_, lo in layout) and buf.numel() % 8 == 0
    out = nccl.views(buf, layout)
    assert all(torch.equal(out[n], t) and out[n].dtype == t.dtype for n, t in tensors)
    words = buf.clone()
    words[9] ^= 1
    assert device_checksum(words) != device_checksum(buf) == device_checksum(buf, chunk_words=3)


def test_fused_group_names():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert fused_group("model.layers.3.self_attn.k_proj.weight", packed) == ("model.layers.3.self_attn.qkv_proj.weight", "k_proj", 3)
    assert fused_group("model.layers.0.mlp.up_proj.weight", packed) == ("model.layers.0.mlp.gate_up_proj.weight", "up_proj", 2)
    assert fused_group("model.layers.0.self_attn.o_proj.weight", packed) == ("model.layers.0.self_attn.o_proj.weight", None, 1)


# -- real vLLM (integration) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def pool(models, tmp_path_factory):
    with ReplicaPool(spec(models[0]), 2, log_dir=tmp_path_factory.mktemp("logs"), request_timeout_s=120) as p:
        p.held = models[0]  # the checkpoint the replicas hold, set by every completed push
        yield p


def held_version(pool) -> int:
    """The version every replica holds; replicas that an earlier (failed) test left apart are resynced."""
    statuses = pool.health_check()
    if len({s["version"] for s in statuses}) > 1 or not all(s["weights_ok"] for s in statuses):
        push(pool, max(s["version"] for s in statuses) + 1, pool.held)
        statuses = pool.health_check()
    return statuses[0]["version"]


def push(pool, version, model_dir, **kw):
    with WeightSender(pool.addresses, pool.authkey, timeout_s=kw.pop("timeout_s", 30), bucket_bytes=SMALL_BUCKET, **kw) as s:
        metrics = s.push(version, 0, 1, iter(state_dict(model_dir).items()))
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"mas-wsync-{os.getpid()}-")]  # segment removed
    pool.held = model_dir
    return metrics


def sample_and_check(pool, model_dir, version):
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, temperature=1.0, seed=version), chunk_size=1)
    assert len(records) == 2 * len(PROMPTS)
    assert {r.policy_version for r in records} == {version}
    assert max_logprob_diff(model_dir, records) < LOGPROB_TOL
    assert [s["version"] for s in pool.health_check()] == [version, version]
    return records


@pytest.mark.integration
def test_update_changes_outputs_and_logprobs_match_transformers(pool, models):
    greedy = Sampling(n=1, max_tokens=12, temperature=0.0)
    version, old = held_version(pool) + 1, pool.held
    new = next(m for m in models if m != old)
    before = pool.generate(PROMPTS, greedy)
    assert max_logprob_diff(old, before) < LOGPROB_TOL
    metrics = push(pool, version, new)
    assert metrics["transports"] == ["shm"]
    assert metrics["buckets"] > 10 and metrics["completed"] == 2 and metrics["replicas"] == 2 and not metrics["failed"]
    assert metrics["bytes"] > sum(t.nbytes for t in state_dict(new).values()) and metrics["gb_per_s"] > 0
    after = pool.generate(PROMPTS, greedy)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert max_logprob_diff(new, after) < LOGPROB_TOL
    records = sample_and_check(pool, new, version)
    assert {r.replica_id for r in records} == {0, 1}  # both replicas received the update and served


@pytest.mark.integration
def test_versions_across_several_syncs_and_transports(pool, models):
    v = held_version(pool)
    for version, model_dir, transport in [(v + 1, models[2], "socket"), (v + 2, models[0], "shm"), (v + 3, models[1], "socket")]:
        assert push(pool, version, model_dir, transport=transport)["transports"] == [transport]
        sample_and_check(pool, model_dir, version)


@pytest.mark.integration
def test_pipeline_stages_hold_generation_until_every_stage_arrived(pool, models):
    held = held_version(pool)
    version = held + 1
    items = list(state_dict(models[2]).items())
    half = len(items) // 2
    sender0 = WeightSender(pool.addresses, pool.authkey, timeout_s=30, bucket_bytes=SMALL_BUCKET)
    sender1 = WeightSender(pool.addresses, pool.authkey, timeout_s=30, bucket_bytes=SMALL_BUCKET)
    try:
        m0 = sender0.push(version, 0, 2, iter(items[:half]))
        assert m0["completed"] == 0  # stage 1 still missing: version not published
        assert all(s["version"] == held and s["updating"] == version for s in pool.health_check())
        result = {}
        gen = threading.Thread(target=lambda: result.update(r=pool.generate(PROMPTS[:2], Sampling(max_tokens=4))))
        gen.start()
        gen.join(1.5)
        assert gen.is_alive()  # held off while the update is incomplete
        m1 = sender1.push(version, 1, 2, iter(items[half:]))
        assert m1["completed"] == 2
        pool.held = models[2]
        gen.join(60)
        assert {r.policy_version for r in result["r"]} == {version}
        sample_and_check(pool, models[2], version)
    finally:
        sender0.close()
        sender1.close()


@pytest.mark.integration
@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_bad_checksum_fails_loudly_and_replica_refuses_until_repaired(pool, models, monkeypatch, transport):
    version = held_version(pool) + 1

    def corrupted(named, cap, alloc):
        for b in iter_buckets(named, cap, alloc):
            if b.index == 3:
                b.payload[-1] ^= 1  # in place: the bytes the replica reads (socket message or segment)
            yield b

    monkeypatch.setattr(sync_mod, "iter_buckets", corrupted)
    with pytest.raises(WeightSyncError, match=rf"version {version}.*replica at 127\.0\.0\.1:\d+.*checksum mismatch"):
        push(pool, version, models[0], transport=transport)
    monkeypatch.undo()
    assert [(s["version"], s["weights_ok"]) for s in pool.health_check()] == [(version - 1, False)] * 2
    assert {r.replica_id for r in pool.replicas_needing_weights()} == {0, 1}
    with pytest.raises(TimeoutError, match="needing weights: \\[0, 1\\]"):
        pool.generate(PROMPTS[:2], Sampling(max_tokens=4), timeout_s=3)
    push(pool, version, models[0])
    sample_and_check(pool, models[0], version)


@pytest.mark.integration
def test_missing_segment_fails_loudly(pool, models, monkeypatch):
    version = held_version(pool) + 1

    def unlinked(named, cap, alloc):
        for b in iter_buckets(named, cap, alloc):
            for name in os.listdir(SHM_DIR):  # the segment vanishes before any replica maps it
                if name.startswith(f"mas-wsync-{os.getpid()}-"):
                    os.unlink(os.path.join(SHM_DIR, name))
            yield b

    monkeypatch.setattr(sync_mod, "iter_buckets", unlinked)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"version {version}.*/dev/shm/mas-wsync-\S+ not found"):
        push(pool, version, models[1])
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    assert [s["weights_ok"] for s in pool.health_check()] == [False, False]
    push(pool, version, models[1])
    sample_and_check(pool, models[1], version)


@pytest.mark.integration
def test_stalled_replica_fails_the_sync_within_its_timeout(pool, models):
    version = held_version(pool) + 1
    pid = pool.pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"version {version}.*replica at 127\.0\.0\.1:{pool.addresses[1][1]}"):
            push(pool, version, models[1], timeout_s=3)
        assert time.monotonic() - t0 < 15
    finally:
        os.kill(pid, signal.SIGCONT)
    push(pool, version, models[0])
    sample_and_check(pool, models[0], version)
