"""The verdict of one weight update (weights/update.py), driven in-process: a fake pool and fake
senders on a one-rank gloo group (a HashStore: no process, no port).

What is checked is the contract `WeightUpdate.push` states: the pool's phases run in order (open,
stream, publish); a replica a sender could not reach is closed without a version and left stale,
not published; the run stops (WeightSyncError) only when no replica took the update while a
target is up and refusing it, or when a sender reports a replica configured unlike the run; a
re-sync makes the sender forget the re-synced replicas first; the tensors are always drained.
"""
from __future__ import annotations

import subprocess
import sys
from typing import cast

import pytest
import torch

from megatron_async.rollout import ReplicaPool
from megatron_async.weights.delta import STRIDE, WHOLE_TENSOR, DeltaEncoder
from megatron_async.weights.update import PushResult, WeightSyncError, WeightUpdate

URLS = ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]


@pytest.fixture
def ctrl(one_rank_group):
    return one_rank_group


class FakePool:
    """ReplicaPool's update phases, recorded; `opens` / `publishes` say which replicas succeed."""

    def __init__(self, opens=(0, 1), publishes=(0, 1), up=(0, 1)):
        self.opens, self.publishes, self._up = list(opens), list(publishes), list(up)
        self.calls: list[tuple] = []

    def begin_update(self, replica_ids, mode, timeout_s):
        self.calls.append(("begin", replica_ids))
        return [i for i in self.opens if replica_ids is None or i in replica_ids]

    def finish_update(self, version, complete, abandoned=()):
        self.calls.append(("finish", version, list(complete), list(abandoned)))
        return [i for i in complete if i in self.publishes]

    def up(self, replica_ids):
        return [i for i in replica_ids if i in self._up]


def as_pool(fake: FakePool) -> ReplicaPool:
    """The fake where WeightUpdate takes a ReplicaPool (it calls only the update phases the fake has)."""
    return cast(ReplicaPool, fake)


class FakeSender:
    """A WeightSender that fails the replicas in `fails` (url -> why), or raises `refuse`."""

    def __init__(self, fails=None, refuse: str | None = None, with_group=()):
        self.fails, self.refuse, self.with_group = dict(fails or {}), refuse, list(with_group)
        self.pushed: list[list[str]] = []
        self.forgotten: list[str] = []
        self.drained = 0
        self.dtypes: list[torch.dtype] = []

    def push(self, named_tensors, urls=None, keep=False):
        assert urls is not None  # WeightUpdate names the replicas of each push
        self.pushed.append(list(urls))
        if self.refuse:
            next(iter(named_tensors))  # a refusal comes after the first bucket started
            raise WeightSyncError(self.refuse)
        self.dtypes += [t.dtype for _, t in named_tensors]
        self.drained = len(self.dtypes)
        failed = {u: why for u, why in self.fails.items() if u in urls}
        return PushResult(bytes=8, replicas=len(urls) - len(failed), buckets=1, failed=failed,
                          failed_with_group=[u for u in self.with_group if u in failed], carriers=["fake"])

    def forget(self, urls):
        self.forgotten += list(urls)

    def close(self):
        pass


def tensors(n=3):
    return iter([(f"w{i}", torch.zeros(2)) for i in range(n)])


def update(ctrl, pool, sender):
    return WeightUpdate(ctrl, URLS, "between_batches", timeout_s=5.0, stage=0, pool=pool, sender=sender)


def test_a_full_update_opens_streams_and_publishes_every_replica(ctrl):
    pool, sender = FakePool(), FakeSender()
    result = update(ctrl, pool, sender).push(3, tensors())
    assert pool.calls == [("begin", None), ("finish", 3, [0, 1], [])]
    assert sender.pushed == [URLS] and sender.drained == 3 and not sender.forgotten
    assert result.replicas == 2 and not result.failed


def test_a_replica_the_sender_could_not_reach_is_closed_without_a_version(ctrl):
    pool, sender = FakePool(), FakeSender(fails={URLS[1]: "bucket not received within 5 s"})
    result = update(ctrl, pool, sender).push(4, tensors())
    assert pool.calls[-1] == ("finish", 4, [0], [1])
    assert result.failed == {URLS[1]: "bucket not received within 5 s"}


def test_a_replica_that_did_not_open_gets_nothing(ctrl):
    pool, sender = FakePool(opens=[1]), FakeSender()
    update(ctrl, pool, sender).push(5, tensors())
    assert sender.pushed == [[URLS[1]]] and pool.calls[-1] == ("finish", 5, [1], [])


def test_an_update_that_reached_no_replica_while_both_are_up_stops_the_run(ctrl):
    pool = FakePool()
    sender = FakeSender(fails={u: "refused" for u in URLS})
    with pytest.raises(WeightSyncError, match=r"version 6 reached no replica; replicas \[0, 1\] are up"):
        update(ctrl, pool, sender).push(6, tensors())
    assert pool.calls[-1] == ("finish", 6, [], [0, 1])


def test_replicas_dropped_only_with_their_node_group_are_not_refusing_and_the_update_goes_on(ctrl):
    """One member's failure dropped its node group (weights/broadcast.py): no replica published,
    but which one refuses only a re-sync alone tells; one that failed alone still stops the run."""
    pool = FakePool()
    grouped = FakeSender(fails={u: "dropped with its node group" for u in URLS}, with_group=URLS)
    result = update(ctrl, pool, grouped).push(6, tensors())
    assert result.published == [] and sorted(result.failed) == URLS and result.stop is None
    alone = FakeSender(fails={u: "refused" for u in URLS}, with_group=URLS[:1])
    with pytest.raises(WeightSyncError, match=r"replicas \[1\] are up and refused it"):
        update(ctrl, FakePool(), alone).push(7, tensors())


def test_an_update_that_reached_no_replica_because_they_died_goes_on(ctrl):
    pool = FakePool(up=[])  # both restarting: the loop re-syncs them when they are back
    sender = FakeSender(fails={u: "connection refused" for u in URLS})
    result = update(ctrl, pool, sender).push(7, tensors())
    assert result.replicas == 0 and sorted(result.failed) == URLS


def test_a_replica_that_fails_its_publish_while_up_stops_the_run_only_if_none_published(ctrl):
    update(ctrl, FakePool(publishes=[0]), FakeSender()).push(8, tensors())  # replica 0 took it: go on
    with pytest.raises(WeightSyncError, match=r"replicas \[0, 1\] are up and refused it"):
        update(ctrl, FakePool(publishes=[]), FakeSender()).push(9, tensors())


def test_a_replica_configured_unlike_the_run_stops_it_and_every_update_is_closed(ctrl):
    pool = FakePool()
    sender = FakeSender(refuse="replica 0 has 2 worker(s) but rollout.replica_tp=1")
    feed = tensors(5)
    with pytest.raises(WeightSyncError, match="rollout.replica_tp=1"):
        update(ctrl, pool, sender).push(10, feed)
    assert pool.calls[-1] == ("finish", 10, [], [0, 1])  # nothing published, both closed
    assert next(feed, None) is None  # the rest of the tensors was drained (the TP gathers)


def test_a_resync_forgets_the_replicas_first_and_touches_only_them(ctrl):
    pool, sender = FakePool(), FakeSender()
    update(ctrl, pool, sender).push(11, tensors(), replica_ids=[1])
    assert pool.calls == [("begin", [1]), ("finish", 11, [1], [])]
    assert sender.forgotten == [URLS[1]] and sender.pushed == [[URLS[1]]]


def test_a_rank_without_a_sender_drains_the_tensors_and_reports_nothing(ctrl):
    feed = tensors(4)
    result = update(ctrl, FakePool(), None).push(12, feed)
    assert next(feed, None) is None and result.replicas == 0 and not result.failed


def test_tensors_are_sent_in_the_replicas_dtype(ctrl):
    sender = FakeSender()
    weights = update(ctrl, FakePool(), sender)
    weights.send_dtype = torch.bfloat16  # an fp32 learner, bf16 replicas
    weights.push(1, iter([("w", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))]))
    assert sender.dtypes == [torch.bfloat16, torch.bfloat16]


def test_the_changed_fraction_is_of_the_replicas_dtype_and_sampled_in_large_tensors():
    """fp32 steps of 1e-4 on weights near 1 change every fp32 element and none in bf16 (half a bf16
    unit there is 2e-3); a tensor above WHOLE_TENSOR elements is sampled every STRIDE-th element.
    The encoder counts what `WeightUpdate` streams: the tensors already cast to the replicas' dtype."""
    base = {"small": torch.ones(100), "large": torch.ones(WHOLE_TENSOR * 4)}
    stepped = {name: t + 1e-4 for name, t in base.items()}
    for dtype, expected in [(torch.float32, 1.0), (torch.bfloat16, 0.0)]:
        meter = DeltaEncoder(keep_whole=False)
        list(meter.encode((n, t.to(dtype)) for n, t in base.items()))
        assert (meter.changed, meter.compared) == (0, 0)  # nothing to compare the first push with
        cast = {n: t.to(dtype) for n, t in stepped.items()}
        out = list(meter.encode(iter(cast.items())))
        assert [n for n, _ in out] == ["small", "large"] and out[0][1] is cast["small"]  # passed through
        assert meter.compared == 100 + -(-WHOLE_TENSOR * 4 // STRIDE)
        assert meter.changed / meter.compared == expected
    meter = DeltaEncoder(keep_whole=False)
    list(meter.encode(iter(base.items())))
    half = base["large"].clone()
    half[: half.numel() // 2] += 1.0
    list(meter.encode(iter({"small": base["small"], "large": half}.items())))
    assert abs(meter.changed - WHOLE_TENSOR * 2 / STRIDE) <= 1  # the sampled elements of the changed half


def test_rank0s_result_carries_the_changed_fraction_from_the_second_push_on(ctrl):
    pool, sender = FakePool(), FakeSender()
    weights = WeightUpdate(ctrl, URLS, "between_batches", timeout_s=5.0, stage=0, pool=as_pool(pool), sender=sender,
                           encoder=DeltaEncoder(keep_whole=False))
    assert weights.push(1, tensors()).changed_fraction is None
    changed = iter([("w0", torch.ones(2)), ("w1", torch.zeros(2)), ("w2", torch.zeros(2))])
    assert weights.push(2, changed).changed_fraction == pytest.approx(2 / 6)
    assert sender.drained == 6


def test_the_vllm_adapter_refuses_a_vllm_it_was_not_written_for():
    """weights/vllm_plugin.py touches vLLM internals read from one release series: another fails
    at once, naming both versions and the fix, instead of misbehaving inside a sync."""
    from megatron_async.weights.vllm_plugin import VLLM_SERIES, VllmVersionError, check_vllm_version

    series = ".".join(map(str, VLLM_SERIES))
    check_vllm_version(f"{series}.0")
    check_vllm_version(f"{series}.1rc1")
    for other in ["0.33.0", "0.31.2", "1.0.0", "dev"]:
        with pytest.raises(VllmVersionError, match=rf"vLLM {other} is installed.*vllm=={series}\.0"):
            check_vllm_version(other)


@pytest.mark.integration  # a fresh process
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs a CPU with AMX (amx_tile)")
def test_the_vllm_plugin_gets_this_process_the_amx_tile_state():
    """vLLM's CPU bf16 kernels run AMX tile instructions without asking Linux first: the plugin vLLM
    runs in each of its processes asks (weights/vllm_plugin.allow_amx_tiles). Read back with
    arch_prctl(ARCH_GET_XCOMP_PERM) in a fresh process, which has asked for nothing before."""
    probe = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_arch_prctl, ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1022, 18
def granted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)
from megatron_async.weights.vllm_plugin import allow_amx_tiles
before = granted()
allow_amx_tiles()
print(before, granted())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout
