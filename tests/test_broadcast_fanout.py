"""The broadcast sender's isolation of replicas (weights/broadcast.py `Fanout`, group formation),
with stand-in channels: what the gloo wire cannot show of the NCCL path, where every replica's
broadcasts share one stream (a replica's broadcasts start only when those queued before them are
done). Real replicas over gloo: tests/test_gloo_wire.py."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import cast

import pytest
import torch

from megatron_async.rollout.replica import ReplicaClient
from megatron_async.weights.broadcast import BroadcastSender, Fanout

BUFFER = 64  # bytes


class Stream:
    """A stand-in for the learner's CUDA stream: sends complete in the order they were queued,
    each once the test lets it (`finish_next`), or never."""

    def __init__(self):
        self.queue: list[Sending] = []


class Sending:
    def __init__(self, stream: Stream, before: "Sending | None"):
        self.stream, self.before, self.done = stream, before, False

    def __call__(self) -> bool:
        return self.done

    def started(self) -> bool:
        return self.before is None or self.before.done


class Channel:
    """On a `Stream` shared with others (NCCL), or, with `gloo`, its broadcasts run at once."""

    def __init__(self, stream: Stream, instant: bool = False, gloo: bool = False):
        self.stream, self.instant, self.gloo = stream, instant, gloo
        self.destroyed_after: list[bool] | None = None

    def send(self, tensors):
        sending = Sending(self.stream, self.stream.queue[-1] if self.stream.queue and not self.gloo else None)
        sending.done = self.instant
        self.stream.queue.append(sending)
        return sending

    def destroy(self):
        self.destroyed_after = [s.done for s in self.stream.queue]  # what had completed when it was aborted


def answered(error: Exception | None = None) -> Future:
    future: Future = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


def fanout(channels, answers, timeout_s=60.0) -> Fanout:
    return Fanout(channels, answers, buffer_bytes=BUFFER, timeout_s=timeout_s, keep=False, group=0,
                  device=torch.device("cpu"))


def broadcast_one_full_buffer(f: Fanout) -> None:
    """One buffer that is not the stream's last (over the cap), as vLLM's producer hands it over."""
    tensor = torch.zeros(BUFFER + 4, dtype=torch.uint8)
    f.record(("w", tensor))
    f.broadcast(tensor)


def test_a_replica_whose_broadcast_never_completes_is_dropped_at_its_deadline_and_the_others_publish():
    hung, live = Channel(Stream(), gloo=True), Channel(Stream(), instant=True, gloo=True)
    f = fanout({("hung",): hung, ("live",): live}, {"hung": Future(), "live": answered()}, timeout_s=0.2)
    broadcast_one_full_buffer(f)
    f.finish()
    assert set(f.failed) == {"hung"} and "within 0 s of when it could start" in f.failed["hung"], f.failed
    assert list(f.channels) == [("live",)] and hung.destroyed_after is not None


def test_a_dropped_replicas_group_is_destroyed_only_after_the_work_queued_before_it():
    """NCCL: replica B answers an error while A's broadcasts, queued before B's on the one stream,
    still run: B's group is aborted only once those are done."""
    stream = Stream()
    a, b = Channel(stream), Channel(stream)
    f = fanout({("a",): a, ("b",): b}, {"a": Future(), "b": Future()})
    broadcast_one_full_buffer(f)  # A's, then B's broadcasts queued; one buffer in flight is allowed
    f.answers["b"].set_exception(RuntimeError("update_weights answered 500"))
    f._settle(in_flight=1)
    assert "b" in f.failed and b.destroyed_after is None
    stream.queue[0].done = True  # A's broadcasts complete
    f._settle(in_flight=1)
    assert b.destroyed_after == [True, False] and "a" not in f.failed


def test_when_the_work_before_a_dropped_group_never_finishes_every_group_of_the_push_is_aborted():
    stream = Stream()
    a, b = Channel(stream), Channel(stream)
    f = fanout({("a",): a, ("b",): b}, {"a": answered(), "b": Future()}, timeout_s=0.2)
    broadcast_one_full_buffer(f)
    f.answers["b"].set_exception(RuntimeError("update_weights answered 500"))
    f.finish()  # A's broadcasts never complete: it misses its deadline; B's never start
    assert set(f.failed) == {"a", "b"} and not f.channels, f.failed
    assert a.destroyed_after is not None and b.destroyed_after is not None


def test_replicas_queued_behind_a_dropped_group_that_never_ends_are_aborted_with_it():
    """NCCL: A's broadcast hangs (its peer went away); B's, queued behind it on the stream, never
    start, and A's group cannot be destroyed alone: after A's deadline and the time A's group was
    given to end, every group of the push is aborted instead of waiting for ever."""
    stream = Stream()
    a, b = Channel(stream), Channel(stream)
    f = fanout({("a",): a, ("b",): b}, {"a": Future(), "b": Future()}, timeout_s=0.2)
    broadcast_one_full_buffer(f)
    broadcast_one_full_buffer(f)  # waits: two buffers in flight per replica is one too many
    assert "within 0 s of when it could start" in f.failed["a"], f.failed
    assert "queued behind a dropped group's" in f.failed["b"], f.failed
    assert not f.channels and a.destroyed_after is not None and b.destroyed_after is not None


def test_a_node_group_is_dropped_whole_when_one_member_fails_and_its_other_members_are_awaited():
    """Replicas A and B share a group (one node), C has its own: B's call answers an error, so A
    and B are dropped (A's reason names B), C goes on; `finish` returns once A answered
    (its receive ended with its group), not before."""
    ab, c = Channel(Stream(), gloo=True), Channel(Stream(), instant=True, gloo=True)
    answers = {"a": Future(), "b": Future(), "c": answered()}
    f = fanout({("a", "b"): ab, ("c",): c}, answers, timeout_s=5.0)
    broadcast_one_full_buffer(f)
    answers["b"].set_exception(RuntimeError("update_weights answered 500"))
    threading.Timer(0.3, answers["a"].set_exception, [RuntimeError("receive: connection closed by peer")]).start()
    f.finish()
    assert set(f.failed) == {"a", "b"} and f.dropped == [("a", "b")], f.failed
    assert "answered 500" in f.failed["b"] and "dropped with its node group, whose member b failed" in f.failed["a"]
    assert answers["a"].done() and list(f.channels) == [("c",)] and ab.destroyed_after is not None


def test_replicas_are_grouped_by_the_host_of_their_url_and_one_dropped_with_its_group_goes_alone():
    urls = ["http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.2:8001", "http://10.0.0.2:8002"]
    sender = BroadcastSender(urls, "key", wire=BlockingWire(), replica_tp=1, timeout_s=1, bucket_bytes=BUFFER,
                             address="10.0.0.1")
    try:
        a, b, c, d = urls
        assert sender.layout(urls) == [(a, c, d), (b,)]
        assert sender.layout([d, c]) == [(c, d)]  # a re-sync of some: their own group
        sender._solo.add(c)  # dropped with its node group: alone until a push reaches it
        assert sender.layout(urls) == [(a, d), (b,), (c,)]
    finally:
        sender.close()


@pytest.mark.parametrize("transport, urls, pp, turns", [
    ("gloo", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 2, 2),  # a node group: the stages in turn
    ("gloo", ["http://10.0.0.2:1", "http://10.0.0.3:1"], 2, 1),  # a replica per host: at once
    ("gloo", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 1, 1),
    ("shm", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 2, 1),  # no groups
])
def test_the_stages_stream_in_turn_only_where_a_group_spans_several_replicas(transport, urls, pp, turns):
    from megatron_async.config import load_config
    from megatron_async.learner.parallel import ParallelLayout
    from megatron_async.run_plan import build_plan
    from megatron_async.weights.build import stage_turns

    plan = build_plan(load_config(None, [f"rollout.weight_transport={transport}"]))
    layout = ParallelLayout(0, pp, 1, pp, 1, 0, 0, 0, torch.device("cpu"))
    assert stage_turns(plan, layout, urls) == turns


class BlockingWire:
    transport = "gloo"

    def open(self, *args):
        threading.Event().wait()  # a rendezvous (or ncclCommInitRank) that never returns


class BlockingClient:
    def world_size(self) -> int:
        return 1

    def init_weight_transfer(self, info: dict) -> None:
        threading.Event().wait()

    def close(self) -> None:
        pass


@pytest.mark.integration  # in-process, but the init payload is vLLM's (importing vLLM starts a process)
def test_group_formation_that_never_returns_is_given_up_at_its_bound_on_daemon_threads():
    url = "http://127.0.0.1:1"
    sender = BroadcastSender([url], "key", wire=BlockingWire(), replica_tp=1, timeout_s=0.3, bucket_bytes=BUFFER)
    sender._clients[url] = cast(ReplicaClient, BlockingClient())  # its init call never returns
    before = set(threading.enumerate())
    try:
        with pytest.raises(TimeoutError, match="did not form within"):
            sender._connect((url,))
        stuck = [t for t in set(threading.enumerate()) - before if t.name == "weight-sync-formation"]
        assert len(stuck) == 2 and all(t.daemon for t in stuck)  # never joined at exit, no pool thread taken
    finally:
        sender.close()


def stream_of(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Tensors of these many elements, alternating float32 / bfloat16 / int32, distinct values."""
    dtypes = [torch.float32, torch.bfloat16, torch.int32]
    return [(f"t{i}", torch.arange(n).to(dtypes[i % 3]) + i) for i, n in enumerate(sizes)]


@pytest.mark.integration  # in-process over a real gloo group, with vLLM's producer and consumer
@pytest.mark.parametrize("sizes", [[], [4, 4], [4, 4, 10], [40], [2, 30, 4, 8, 16, 2]],
                         ids=["empty", "one-buffer", "last-buffer-full", "over-the-cap", "several"])
def test_vllms_packed_buffers_with_inband_headers_arrive_whole_and_in_order(sizes):
    """The wire end to end in one process: vLLM's packed producer over a `Fanout` into one gloo
    group, vLLM's packed consumer at the other end reading the in-band headers; every stream
    shape that decides where the stream ends (no tensor; the last buffer under the cap; the last
    buffer full, so an end header follows; a tensor larger than a buffer)."""
    from megatron_async.rollout.launcher import free_port
    from megatron_async.weights import vllm_plugin
    from megatron_async.weights.broadcast import NUM_BUFFERS, GlooCommunicator, on_daemon_thread
    from megatron_async.weights.engines import inband_manifest

    port = free_port("127.0.0.1")
    cpu = torch.device("cpu")
    packed = vllm_plugin.packed_tensor()
    loaded: list[tuple[str, torch.Tensor]] = []

    def replica() -> None:
        group = GlooCommunicator.join("127.0.0.1", port, 1, 2, 30)
        packed.packed_nccl_broadcast_consumer(
            iterator=inband_manifest(group, cpu, lambda: None), group=group, src=0,
            post_unpack_func=lambda named: loaded.extend((n, t.clone()) for n, t in named),
            buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS, device=cpu)
        group.destroy()

    answer = on_daemon_thread(replica)
    channel = GlooCommunicator.join("127.0.0.1", port, 0, 2, 30)
    tensors = stream_of(sizes)
    f = Fanout({("r",): channel}, {"r": answer}, buffer_bytes=BUFFER, timeout_s=30, keep=False, group=0, device=cpu)
    packed.packed_nccl_broadcast_producer(iterator=f.items(iter(tensors)), group=f, src=0, post_iter_func=f.record,
                                          buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS)
    f.finish()
    channel.destroy()
    assert not f.failed and answer.result() is None, f.failed
    assert [n for n, _ in loaded] == [n for n, _ in tensors]
    for (_, got), (_, sent) in zip(loaded, tensors):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
