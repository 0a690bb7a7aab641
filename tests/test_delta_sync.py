"""Delta weight sync (weights/delta.py): the encoder and decoder in process, and the update's
choice of full or delta pushes (`WeightUpdate.local`, the host-memory sender) with a fake replica
client. The real replicas' delta sync runs in tests/test_weight_sync.py."""
from __future__ import annotations

import base64
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from megatron_async.rollout import ReplicaPool
from megatron_async.rollout.replica import ReplicaError
from megatron_async.run_plan import AUTO_FULL_EVERY, resolve_full_every
from megatron_async.weights.delta import DELTA_SUFFIX, DeltaBaseError, DeltaDecoder, DeltaEncoder, decode_delta, encode_delta
from megatron_async.weights.host_memory import unpack_bucket
from megatron_async.weights.update import WeightUpdate


def version(seed: int, base: dict | None = None, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """bf16 weights; from `base`, `fraction` of each tensor's elements changed."""
    gen = torch.Generator().manual_seed(seed)
    if base is None:
        return {"a.weight": torch.randn(64, 33, generator=gen).bfloat16(), "b.bias": torch.randn(7, generator=gen).bfloat16()}
    out = {}
    for name, t in base.items():
        flat = t.clone().reshape(-1)
        pick = torch.rand(flat.numel(), generator=gen) < fraction
        flat[pick] = flat[pick] + 1.0
        out[name] = flat.view(t.shape)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 3, 50])
def test_the_wire_form_round_trips(dtype, n):
    index = torch.randperm(1000)[:n].sort().values
    values = torch.randn(n).to(dtype)
    got_index, got_values = decode_delta(encode_delta(index, values), dtype)
    assert torch.equal(got_index, index) and torch.equal(got_values, values)


def test_deltas_rebuild_every_version_and_are_smaller_than_the_tensors():
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    weights = version(0)
    sent = dict(encoder.encode(weights.items(), delta=True))  # no base yet: whole
    assert sent.keys() == weights.keys()
    assert all(torch.equal(decoder.decode(n, t)[1], weights[n]) for n, t in sent.items())
    for seed in (1, 2, 3):
        weights = version(seed, weights)
        sent = dict(encoder.encode(weights.items(), delta=True))
        assert "a.weight" + DELTA_SUFFIX in sent and len(sent) == 2
        assert sum(t.nbytes for t in sent.values()) < sum(t.nbytes for t in weights.values()) / 5
        loaded = dict(decoder.decode(n, t) for n, t in sent.items())
        assert all(torch.equal(loaded[n], weights[n]) for n in weights)


def test_a_change_of_bits_alone_is_carried():
    """Changed means the bits differ: -0.0 after 0.0 and one NaN after another are sent, so the
    replica's copy is the sender's bit for bit (a float comparison misses the first, and calls
    an unchanged NaN changed)."""
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    before = torch.zeros(64, dtype=torch.bfloat16)
    before[1] = float("nan")
    for n, t in encoder.encode([("w", before)], delta=True):
        decoder.decode(n, t)
    after = before.clone()
    after[0] = -0.0
    after[1:2].view(torch.int16).add_(1)  # another NaN payload
    sent = dict(encoder.encode([("w", after)], delta=True))
    assert list(sent) == ["w" + DELTA_SUFFIX]
    assert decode_delta(sent["w" + DELTA_SUFFIX], torch.bfloat16)[0].tolist() == [0, 1]
    loaded = decoder.decode("w" + DELTA_SUFFIX, sent["w" + DELTA_SUFFIX])[1]
    assert torch.equal(loaded.view(torch.int16), after.view(torch.int16))


def test_a_delta_applied_twice_gives_the_same_weights():
    """Overwrite, not add: a retried bucket is idempotent."""
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    weights = version(0)
    for n, t in encoder.encode(weights.items(), delta=True):
        decoder.decode(n, t)
    weights = version(1, weights, fraction=0.1)
    sent = list(encoder.encode(weights.items(), delta=True))
    for _ in range(2):
        loaded = dict(decoder.decode(n, t) for n, t in sent)
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)


def test_a_mostly_changed_tensor_is_sent_whole():
    """fp32 after an Adam step: ~90% changed; 8 bytes per element as a delta against 4 whole."""
    encoder = DeltaEncoder()
    weights = {"w": torch.randn(100, 10)}
    list(encoder.encode(weights.items(), delta=True))
    moved = {"w": weights["w"] + torch.where(torch.rand(100, 10) < 0.9, 1e-3, 0.0)}
    assert [n for n, _ in encoder.encode(moved.items(), delta=True)] == ["w"]


def test_a_delta_without_a_base_is_refused_by_name():
    encoder = DeltaEncoder()
    weights = version(0)
    list(encoder.encode(weights.items(), delta=False))
    sent = dict(encoder.encode(version(1, weights).items(), delta=True))
    with pytest.raises(DeltaBaseError, match="a.weight.*full sync"):
        DeltaDecoder().decode("a.weight" + DELTA_SUFFIX, sent["a.weight" + DELTA_SUFFIX])


class FakeClient:
    """Records what one replica's engine would receive; fails the push when told to."""

    def __init__(self, url: str):
        self.url, self.fail, self.decoder = url, False, DeltaDecoder()
        self.pushes: list[dict] = []

    def update_weights(self, info: dict) -> None:
        if self.fail:
            raise ReplicaError(f"{self.url}: told to fail", 500)
        tensors = unpack_bucket(base64.b64decode(info["data"]), info["checksum"], None)
        assert info["keep"]
        self.pushes.append(dict(self.decoder.decode(n, t.clone()) for n, t in tensors.items()))
        self.pushes[-1]["#names"] = sorted(tensors)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("setting, transport, urls, dtype, full_every", [
    ("auto", "auto", ["http://10.0.0.1:1"], torch.bfloat16, AUTO_FULL_EVERY),   # bytes cost time
    ("auto", "auto", ["http://127.0.0.1:1"], torch.bfloat16, 0),               # shm: a delta costs more
    ("auto", "http", ["http://127.0.0.1:1"], torch.bfloat16, AUTO_FULL_EVERY),
    ("auto", "auto", ["http://10.0.0.1:1"], torch.float32, 0),                 # fp32: most elements change
    (0, "auto", ["http://10.0.0.1:1"], torch.bfloat16, 0),
    (4, "shm", ["http://127.0.0.1:1"], torch.float32, 4),
    ("auto", "gloo", ["http://127.0.0.1:1"], torch.bfloat16, 0),  # the replica's loading sets the time
    ("auto", "gloo", ["http://127.0.0.1:1"], torch.float32, 0),
    ("auto", "nccl", ["http://127.0.0.1:1"], torch.bfloat16, 0),               # no delta path over nccl
])
def test_auto_sends_deltas_to_2_byte_replicas_over_http_only(setting, transport, urls, dtype, full_every):
    assert resolve_full_every(setting, transport, urls, dtype)[0] == full_every


class FakePool:
    """ReplicaPool's update phases, as `WeightUpdate.local` drives them: every replica opens, and
    the version is published on those the push reached."""

    def __init__(self, urls: list[str]):
        self.urls, self.spec = urls, SimpleNamespace(dtype="bfloat16")

    def begin_update(self, replica_ids, mode, timeout_s):
        return list(range(len(self.urls))) if replica_ids is None else list(replica_ids)

    def finish_update(self, version, complete, abandoned=()):
        return list(complete)

    def up(self, replica_ids):
        return list(replica_ids)


def test_the_update_sends_deltas_between_full_pushes_and_a_full_one_after_a_failure(monkeypatch):
    from megatron_async.weights import host_memory

    urls = ["http://10.0.0.1:1", "http://10.0.0.2:1"]
    clients = {u: FakeClient(u) for u in urls}
    monkeypatch.setattr(host_memory, "ReplicaClient", lambda url, key, timeout_s: clients[url])
    sender = host_memory.HostMemorySender(urls, "key", transport="http")
    update = WeightUpdate.local(cast(ReplicaPool, FakePool(urls)), sender, full_every=3)  # its update phases
    weights, kinds = version(0), []
    for step in range(7):
        clients[urls[1]].fail = step == 3
        result = update.push(step + 1, iter(weights.items()))
        kinds.append("delta" if result.delta else "full")
        for url in urls:
            if url not in result.failed:
                got = clients[url].pushes[-1]
                assert all(torch.equal(got[n], weights[n]) for n in weights), (step, url)
        weights = version(step + 10, weights)
    # every 3rd push full; step 3 failed on one replica, so step 4 is full for both
    assert kinds == ["full", "delta", "delta", "full", "full", "delta", "delta"]
    assert "a.weight" + DELTA_SUFFIX in clients[urls[0]].pushes[1]["#names"]
    update.forget([urls[0]])
    assert not update.push(8, iter(weights.items())).delta
    update.close()
