"""The broadcast transport: vLLM's NCCL weight-transfer protocol, on NCCL (GPU) or gloo (any host),
written top to bottom as a push goes: the wires (`Wire`: `NcclWire`, `GlooWire` and the gloo group
both ends of that wire use, `GlooCommunicator`), the fan-out vLLM's packed producer broadcasts on
(`Fanout`), then the sender (`BroadcastSender`).

    sender = BroadcastSender(pool.urls, pool.key, wire=make_wire("gloo"), replica_tp=1, timeout_s=120, bucket_bytes=...)
    result = sender.push(iter_hf_weights(...), urls=opened)      # between begin_update and finish_update

`rollout.weight_transport: nccl | gloo`. The replicas run vLLM's dense NCCL engine
(vllm/distributed/weight_transfer/nccl_engine.py) as `mas_nccl`, or the same engine with a gloo
communicator as `mas_gloo` (weights/engines.py). Each learner pipeline stage has its own
sender (its TP rank 0 of DP rank 0, weights/update.py), and each sender one group per replica
node (`BroadcastSender.layout`: the replicas whose URLs name one host), so that a stage's bytes
cross into a node once: the sender is rank 0, the node's k-th replica's W workers ranks
1 + k x W .. (vLLM's `rank_offset` layout; W is the replica's TP x PP, asked of the server,
`/get_world_size`, and refused unless it equals rollout.replica_tp). A replica's engine holds its groups side by side, one per stage (`group` =
the stage, in the init call and in each push's `/update_weights` and buffer headers). We drive it as vLLM's
trainer-side engine (`NCCLTrainerWeightTransferEngine`) does, keeping the pool's phases
(`ReplicaPool.begin_update` / `finish_update`, run by weights/update.py):
- one `/update_weights` per stage per push (its group; no names), while vLLM's
  `packed_nccl_broadcast_producer` packs the stage's tensors into buffers of `bucket_bytes`,
  double-buffered, each preceded by its manifest (a JSON header: `Fanout` says why in-band); the
  replica runs vLLM's packed consumer and loads each buffer through layerwise reload;
- the groups persist: formed at the first push (`/init_weight_transfer_engine` to each member
  while this process opens its end, a TCP store rendezvous at `address:port`), formed again only
  when a push's replicas of a node differ from its group's (`layout`: a replica left out of a
  push, a re-sync of some, one back from a failure) or after a failure (`forget`); a replica's
  engine replaces its old group of that stage when a new one forms.

A node group fails whole: one member that fails a push (killed, a load that raises, a deadline)
drops its group's other members from that push too (`Fanout`; their receive ends when the group
does). They lose that push, never the run: each member of a failed node group is `_solo` (its
re-sync and pushes go through a group of its own until one reaches it), and weights/update.py
counts none of them as refusing; the re-syncs tell which one fails alone. So a replica that keeps
failing costs the others one push; a restarted replica is re-synced alone anyway (the pool
leaves it out of full pushes), and the next full push re-forms the node group with it.

Why a group per stage, side by side, and not the stages in turn through one group (vime PR #329,
for vLLM's stock engine, which keeps one receiving communicator): a broadcast has one source, so
one group serves one stage at a time, and in turn every stage but the first waits for the one
before it and forms its group again at each sync (a rendezvous per stage per sync). Side by side,
the stages stream at once: the replica still loads one buffer at a time (its engine serves one
`/update_weights` after the other), but each stage's gathers, casts and sends overlap the others'
loading, and no group is formed after the first sync. Argued from the protocol, not measured
against the other (docs/replicas-and-weight-sync.md, "Pipeline-parallel learners").

Only the communicator differs between the wires (`Wire`: NcclWire = vLLM's PyNccl, GlooWire =
`GlooCommunicator`): group formation, the rank layout, the packed protocol, re-forming, timeouts
and failure handling are this module's code for both. CI runs it over gloo against real vLLM CPU
replicas; the CUDA communicator alone runs on GPUs only.

Every wait is bounded by `timeout_s`:
- forming a group: the replica's init call and this end's rendezvous are awaited together, so a
  replica that refuses init fails at once, not at the store's timeout;
- a buffer: its broadcasts to every group are enqueued (NCCL: on the producer's stream;
  gloo: asynchronous work), and each group is polled on its own (`Fanout`: its members' answers,
  its channel, its deadline counted from when its broadcasts can start); a group that fails is
  dropped from the push with its replicas (`PushResult.failed`), destroyed once the work queued
  before it is done. CI runs this over gloo, whose work is per group, and with stand-in channels for the
  stream's order (tests/test_broadcast_fanout.py); the CUDA stream itself is the GPU run's to show;
- forming a group runs on daemon threads (NCCL's init has no timeout: given up, never joined).

Ports: stage s's group whose first replica is replica i rendezvous at `base_port + s * len(urls)
+ i` (or a free port when `base_port` is 0). Groups (nodes) are served one after the other on one
stream: sync time grows with replica nodes, not with replicas.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence
from urllib.parse import urlparse

import torch

from megatron_async.transports import LOOPBACK_HOSTS
from megatron_async.rollout.launcher import free_port
from megatron_async.rollout.replica import ReplicaClient
from megatron_async.weights import vllm_plugin
from megatron_async.weights.update import PushResult, WeightSyncError


Members = tuple[str, ...]  # the replicas of one group (one host's), in rank order


class Sending(Protocol):
    """One `Channel.send` in flight."""

    def __call__(self) -> bool:
        """True once every tensor was sent; raises if the group failed."""

    def started(self) -> bool:
        """Whether the work queued before these broadcasts is done, so that they can run (on NCCL
        every group's broadcasts share the learner's stream; a gloo group's run on their own)."""


class Channel(Protocol):
    """The sender's end (rank 0) of one replica's group."""

    def send(self, tensors: Sequence[torch.Tensor]) -> Sending:
        """Enqueue the broadcast of `tensors` in order."""

    def destroy(self) -> None:
        """End the group now, without blocking, even with a broadcast in flight."""


class Wire(Protocol):
    transport: str  # rollout.weight_transport

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> Channel:
        """Host the rendezvous of a `world_size`-rank group at address:port as rank 0; returns once
        every rank joined (or raises after `timeout_s`)."""


class NcclWire:
    """vLLM's PyNccl communicator on the learner's CUDA device."""

    transport = "nccl"

    def __init__(self):
        # the group opens on a side thread (see BroadcastSender._connect): its device is read here,
        # on the learner's thread; vLLM's warm-up then sets a stream of its own on that side thread
        # only, and the learner's thread keeps its current stream
        self.device = torch.cuda.current_device()

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> "NcclChannel":
        return NcclChannel(vllm_plugin.pynccl_sender(address, port, world_size, timeout_s, self.device))


class NcclChannel:
    def __init__(self, communicator):
        self.communicator = communicator

    def send(self, tensors: Sequence[torch.Tensor]) -> "EventSending":
        stream = torch.cuda.current_stream()
        ready = torch.cuda.Event()  # the work queued before these broadcasts is done
        ready.record(stream)
        for tensor in tensors:
            self.communicator.broadcast(tensor, src=0, stream=stream)
        sent = torch.cuda.Event()
        sent.record(stream)
        return EventSending(ready, sent)

    def destroy(self) -> None:
        self.communicator.destroy()  # ncclCommAbort, in a daemon thread joined for at most 5 s


class EventSending:
    """NCCL broadcasts on a stream, between two events. NOTE: `Event.query` never raises: a hung peer
    shows only as a deadline passed (weights/broadcast.py `Fanout`)."""

    def __init__(self, ready: torch.cuda.Event, sent: torch.cuda.Event):
        self.ready, self.sent = ready, sent

    def __call__(self) -> bool:
        return self.sent.query()

    def started(self) -> bool:
        return self.ready.query()


class GlooWire:
    """`GlooCommunicator`: vLLM's stateless gloo group (CPU tensors; CUDA ones staged through host memory)."""

    transport = "gloo"

    def open(self, address: str, port: int, world_size: int, timeout_s: float) -> "GlooCommunicator":
        return GlooCommunicator.join(address, port, 0, world_size, timeout_s)


class GlooCommunicator:
    """A gloo process group with the calls vLLM's NCCL weight-transfer engine makes on its PyNccl
    communicator (`broadcast(tensor, src, stream)`, `destroy()`), plus the sender's non-blocking
    end (`send`). Both ends of the gloo wire use it: this module's sender (rank 0) and the
    replica's `mas_gloo` engine (weights/engines.py, ranks 1..W-1), so that the rest of the NCCL
    path, ours and vLLM's, runs unchanged over TCP. The group is vLLM's own stateless one
    (`vllm_plugin.stateless_gloo_group`: a TCP store rendezvous at the sender, no global
    torch.distributed state), so it lives beside the learner's process groups. Gloo moves CPU
    tensors: a CUDA tensor is staged through host memory on either end."""

    def __init__(self, group: torch.distributed.ProcessGroup):
        self.group: torch.distributed.ProcessGroup | None = group  # None once destroyed
        self._in_flight: list = []  # the sender's broadcasts not yet known complete

    @classmethod
    def join(cls, address: str, port: int, rank: int, world_size: int, timeout_s: float) -> "GlooCommunicator":
        """Join (rank 0: host) the group's rendezvous at address:port; returns once all ranks joined.
        Every blocking call of the group is bounded by `timeout_s`.

        Rank 0 hosts the rendezvous's store on a socket it binds itself (vLLM's `listen_socket`):
        without it, torch's tcp:// rendezvous under torchrun (TORCHELASTIC_USE_AGENT_STORE=True, as on
        every learner rank) makes no rank the store's server, and the group never forms (found with a
        PP=2 learner, tests/test_broadcast_pp.py)."""
        # NOTE: vLLM is imported there, not at the top: the communicator itself needs only torch, and
        # gpu_check's weight_wire phase runs it where vLLM is not installed (the lent GPU machine)
        listen = socket.create_server((address, port)) if rank == 0 else None
        return cls(vllm_plugin.stateless_gloo_group(address, port, rank, world_size, timeout_s, listen_socket=listen))

    def _live(self) -> torch.distributed.ProcessGroup:
        if self.group is None:
            raise RuntimeError("gloo weight-transfer group destroyed")
        return self.group

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        """PyNccl's blocking broadcast (`stream` is a CUDA stream there; gloo has none)."""
        group = self._live()
        staged = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        if staged is not tensor and group.rank() == src:
            staged.copy_(tensor)
        group.broadcast(staged, src).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def send(self, tensors: Sequence[torch.Tensor]) -> "WorkSending":
        """Rank 0: start broadcasting `tensors` in order and return at once."""
        group = self._live()
        works = [group.broadcast(t.detach().to("cpu").contiguous(), 0) for t in tensors]
        self._in_flight = [w for w in self._in_flight if not w.is_completed()] + works
        return WorkSending(works)

    def destroy(self) -> None:
        """End the group without blocking; the other ranks' receives fail once its last reference
        (this object's, and its broadcasts' works') is dropped, which closes its connections
        (measured, torch 2.13: `abort()` and `shutdown()` alone leave them open, and a peer waiting
        for a broadcast waits out the group's timeout; a node group's other replicas did). NOTE:
        gloo's `abort()` does not interrupt a send to a peer that stopped reading, and dropping the
        group then blocks until the group's timeout (measured: 19 s of a 20 s timeout); a daemon
        thread holds the group and waits that out instead. It must hold the group itself, not only
        its works: when the sender dropped this communicator, the group went with it, and the sender
        blocked for the whole timeout (a replica whose load raised was reported after
        rollout.sync_timeout_s, not at once)."""
        group, pending = self.group, [w for w in self._in_flight if not w.is_completed()]
        self.group, self._in_flight = None, []
        if group is None:
            return
        group.abort()
        if not pending:
            return

        def release(group: torch.distributed.ProcessGroup = group) -> None:  # holds it until its broadcasts ended
            for w in pending:
                try:
                    w.wait()
                except RuntimeError:  # the peer closed it, or the group's timeout fired
                    pass
            del group  # the group's last reference: dropped in this thread

        threading.Thread(target=release, name="gloo-release", daemon=True).start()


class WorkSending:
    """Gloo broadcasts: asynchronous work of their own group, which can run at once."""

    def __init__(self, works: list):
        self.works = works

    def __call__(self) -> bool:
        if not all(w.is_completed() for w in self.works):
            return False
        for w in self.works:
            w.wait()  # raises the failure of a completed-with-error broadcast
        return True

    def started(self) -> bool:
        return True


def make_wire(transport: str) -> Wire:
    wires: dict[str, type[Wire]] = {"nccl": NcclWire, "gloo": GlooWire}
    if transport not in wires:
        raise ValueError(f"rollout.weight_transport={transport!r}: the broadcast sender takes {' or '.join(wires)}")
    return wires[transport]()


def update_info(bucket: Sequence[tuple[str, torch.Tensor]], keep: bool = False, group: int = 0) -> dict:
    """vLLM's `NCCLWeightTransferUpdateInfo` of some tensors, as JSON: a buffer's header (`Fanout`),
    or with none the stage's `/update_weights`;
    `keep`: the replica keeps what it loads, the base of the next delta (weights/delta.py);
    `group`: the pipeline stage whose group carries the tensors (weights/engines.py)."""
    return {"names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "keep": keep, "group": group}


NUM_BUFFERS = 2  # packed buffers in flight (vLLM's DEFAULT_PACKED_NUM_BUFFERS): double-buffered


def header_tensors(header: dict | None, device: torch.device) -> list[torch.Tensor]:
    """A buffer's in-band manifest as broadcast before it: its JSON length (int64 [1]), then its
    bytes (uint8); None (the end of the stream): the length 0 alone. JSON, never pickle."""
    if header is None:
        return [torch.zeros(1, dtype=torch.int64, device=device)]
    raw = json.dumps(header).encode()
    return [torch.tensor([len(raw)], dtype=torch.int64, device=device),
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)]


@dataclass
class Sent:
    """One buffer in flight to one replica."""

    sending: Sending
    tensors: list[torch.Tensor]  # referenced until sent
    started_at: float | None = None  # when its broadcasts could start (`Sending.started` first seen True)


class Fanout:
    """The communicator vLLM's packed producer (`packed_nccl_broadcast_producer`) broadcasts on:
    each packed buffer goes to every live group's channel (one per replica node, `BroadcastSender`),
    preceded by its manifest (`header_tensors`: `update_info` of the buffer's tensors and whether
    it is the stream's last), each group bounded on its own.

    The producer packs a buffer while the previous ones are in flight; `broadcast` then waits
    until at most `NUM_BUFFERS - 1` buffers per group are unfinished (on CUDA the producer's
    streams already order them: this bounds the waits; on a host, whose slots are no-ops, it is the
    double buffering). A group is dropped with all its replicas (`failed`; the other groups go on)
    when one member's call answers an error (the others' reasons name it), its broadcast fails, or a
    buffer of it is not sent within `timeout_s` of when its broadcasts could start (on NCCL, once
    the groups queued before it on the stream are done: one slow group does not spend the others'
    time). A dropped group is destroyed once the work queued before its broadcasts is done (at once
    on gloo): aborting an NCCL communicator whose kernels still wait behind live groups' on the
    stream is undefined. If that never comes, every group of the push is aborted (`finish`).
    `finish` then waits (bounded) for the dropped node groups' members to answer: their receive
    ends when their group does (gloo: the sender's end closes; NCCL: their `Watchdog`), and their
    engine must be free before the pool closes their update.

    Why the manifest travels in-band and not in the call: the stage's stream is produced lazily
    (TP gathers) and a delta's tensors have data-dependent sizes, so it is known only as it is
    packed; vLLM's consumer takes its manifest as an iterator, which the replica feeds from these
    headers (weights/engines.py)."""

    def __init__(self, channels: dict[Members, Channel], answers: dict[str, Future], *, buffer_bytes: int,
                 timeout_s: float, keep: bool, group: int, device: torch.device):
        self.channels, self.answers = dict(channels), answers
        self.buffer_bytes, self.timeout_s, self.keep, self.group, self.device = buffer_bytes, timeout_s, keep, group, device
        self.failed: dict[str, str] = {}  # url -> why it was dropped
        self.dropped: list[Members] = []  # the groups dropped (destroyed here)
        self.bytes = self.buffers = 0
        self.wait_seconds = 0.0
        self._chunk: list[tuple[str, torch.Tensor]] = []  # the buffer being packed: (name, a meta tensor of its shape)
        self._sent: dict[Members, list[Sent]] = {m: [] for m in channels}
        self._doomed: dict[Members, tuple[Channel, Sent | None]] = {}  # dropped, destroyed once its last send started
        self._doomed_at: dict[Members, float] = {}  # ... since when
        self._expects_header = True  # the replicas read another header before the stream ends

    def record(self, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        """The producer's `post_iter_func`: notes each tensor of the buffer being packed."""
        name, tensor = item
        self._chunk.append((name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")))
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def items(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The producer's iterator: the stream, then every buffer in flight waited out (bounded), so
        that the producer's closing stream synchronizations find nothing unbounded to wait for."""
        yield from named_tensors
        self._settle(in_flight=0)

    def broadcast(self, packed: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        last = sum(t.numel() * t.element_size() for _, t in self._chunk) <= self.buffer_bytes  # vLLM's packing rule
        header = update_info(self._chunk, keep=self.keep, group=self.group) | {"last": last}
        self._chunk = []
        self.buffers += 1
        self._expects_header = not last
        self._send([*header_tensors(header, packed.device), packed])
        self._settle(in_flight=0 if last else NUM_BUFFERS - 1)

    def finish(self) -> None:
        """After the producer: end the stream where the replicas expect another header, wait for
        every replica's answer (bounded), destroy the dropped groups, and wait (bounded) for their
        other members' answers."""
        if self._expects_header:
            self._send(header_tensors(None, self.device))
        self._settle(in_flight=0)
        t = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while pending := [u for m in self.channels for u in m if not self.answers[u].done()]:
            if time.monotonic() > deadline:
                for members in [m for m in self.channels if set(m) & set(pending)]:
                    self._fail(members, f"its /update_weights did not answer within {self.timeout_s:.0f} s of the last buffer")
                break
            wait([self.answers[u] for u in pending], timeout=0.05, return_when=FIRST_COMPLETED)
        for members in list(self.channels):
            self._answered_error(members)
        self._destroy_doomed()
        if self._doomed:  # work queued before a dropped group never finished
            self._abort_all("aborted with the push's other groups: a dropped group could not be destroyed "
                            "alone (work queued before it never finished)")
        # a dropped node group's members: their engines free before the pool closes their update
        wait([self.answers[u] for m in self.dropped if len(m) > 1 for u in m], timeout=self.timeout_s)
        self.wait_seconds += time.perf_counter() - t

    def _stuck_behind_doomed(self, busy: list[Members], now: float) -> bool:
        """No busy group's broadcasts could start, and a dropped group has waited `timeout_s` to be
        destroyed: the stream is held by that group's own broadcasts (a peer that went away)."""
        return not any(self._sent[m][0].started_at is not None for m in busy) and any(
            now > since + self.timeout_s for since in self._doomed_at.values())

    def _abort_all(self, reason: str) -> None:
        """Every group of this push destroyed now (their next push forms them again)."""
        for members in list(self.channels):
            self.failed.update(dict.fromkeys(members, reason))
            self._doomed[members] = (self.channels.pop(members), None)
            self.dropped.append(members)
            self._sent.pop(members, None)
        for channel, _ in self._doomed.values():
            channel.destroy()
        self._doomed.clear()
        self._doomed_at.clear()

    def _send(self, tensors: list[torch.Tensor]) -> None:
        for members in list(self.channels):
            if self._answered_error(members):
                continue
            try:
                self._sent[members].append(Sent(self.channels[members].send(tensors), tensors))
            except Exception as e:  # noqa: BLE001 - the group is dropped from this push
                self._fail(members, str(e) or repr(e))

    def _settle(self, in_flight: int) -> None:
        """Wait until every live group has at most `in_flight` buffers unfinished."""
        t = time.perf_counter()
        while True:
            busy = []
            now = time.monotonic()
            for members in list(self.channels):
                if self._answered_error(members):
                    continue
                sent = self._sent[members]
                try:
                    while sent and sent[0].sending():
                        sent.pop(0)
                except Exception as e:  # noqa: BLE001 - its group failed (a peer closed it, or its timeout)
                    self._fail(members, str(e) or repr(e))
                    continue
                if len(sent) <= in_flight:
                    continue
                if sent[0].started_at is None and sent[0].sending.started():
                    sent[0].started_at = now
                if sent[0].started_at is not None and now > sent[0].started_at + self.timeout_s:
                    self._fail(members, f"buffer not received within {self.timeout_s:.0f} s of when it could start")
                else:
                    busy.append(members)
            self._destroy_doomed()
            if not busy:
                break
            if self._stuck_behind_doomed(busy, now):
                self._abort_all("aborted with the push's other groups: their broadcasts were queued behind a dropped "
                                f"group's, which did not end within {self.timeout_s:.0f} s")
                break
            answering = [self.answers[u] for m in busy for u in m if not self.answers[u].done()]
            if answering:
                wait(answering, timeout=0.005, return_when=FIRST_COMPLETED)
            else:
                time.sleep(0.001)
        self.wait_seconds += time.perf_counter() - t

    def _answered_error(self, members: Members) -> bool:
        for url in members:
            answer = self.answers[url]
            if answer.done() and (error := answer.exception()) is not None:
                self._fail(members, str(error) or repr(error), at_fault=url)
                return True
        return False

    def _fail(self, members: Members, reason: str, at_fault: str | None = None) -> None:
        """Drop the group of `members` from this push (`at_fault`: the member whose call failed it);
        it is destroyed once the work queued before its last broadcasts is done."""
        for url in members:
            self.failed[url] = reason if url == at_fault or at_fault is None else \
                f"dropped with its node group, whose member {at_fault} failed: {reason}"
        sent = self._sent.pop(members, [])
        self._doomed[members] = (self.channels.pop(members), sent[-1] if sent else None)
        self._doomed_at[members] = time.monotonic()
        self.dropped.append(members)
        self._destroy_doomed()

    def _destroy_doomed(self) -> None:
        for members, (channel, last) in list(self._doomed.items()):
            if last is None or last.sending.started():
                del self._doomed[members], self._doomed_at[members]
                channel.destroy()


def address_towards(url: str) -> str:
    """The address of this host on the route to `url`'s host: where that replica can reach a
    rendezvous here (127.0.0.1 for a loopback replica). Not the host name, which may resolve to
    127.0.1.1 or to another interface."""
    parsed = urlparse(url)
    if parsed.hostname in LOOPBACK_HOSTS:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 80))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _vllm_init_info(address: str, port: int, world_size: int, rank_offset: int, group: int, buffer_bytes: int,
                    timeout_s: float) -> dict:
    """The `/init_weight_transfer_engine` payload of vLLM's NCCL engine family (packed mode, its
    buffer geometry; the replica's workers take ranks `rank_offset`.. of `world_size`), with the
    group (pipeline stage) our engines key their groups by and the sync timeout that bounds the
    replica's receive."""
    # NOTE: vLLM is imported here, not at the top: only the sender of a broadcast transport needs
    # it, and importing it costs seconds (and CUDA probing) on every learner rank
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    return worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size, packed=True,
        packed_buffer_size_bytes=buffer_bytes, packed_num_buffers=NUM_BUFFERS)) | {"group": group, "timeout_s": timeout_s}


class GroupNotFormed(Exception):
    """Some members' own calls failed while their group formed (`errors`: url -> why)."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(errors.values()))
        self.errors = errors


class BroadcastSender:
    """One pipeline stage's sender rank's groups with the replicas (one per replica node), and the
    packed stream over them."""

    def __init__(self, urls: Sequence[str], key: str, *, wire: Wire, replica_tp: int, timeout_s: float,
                 bucket_bytes: int, address: str = "", base_port: int = 0, stage: int = 0):
        self.wire, self.replica_tp, self.stage = wire, replica_tp, stage
        self.timeout_s, self.bucket_bytes, self.base_port = timeout_s, bucket_bytes, base_port
        self._index = {u: i for i, u in enumerate(urls)}
        self._host = {u: urlparse(u).hostname for u in urls}  # the node key of the groups
        self._address = {u: address or address_towards(u) for u in urls}
        self._clients = {u: ReplicaClient(u, key, timeout_s=timeout_s, label=f"replica {i}") for i, u in enumerate(urls)}
        self._groups: dict[Members, Channel] = {}  # disjoint; this end of each, formed by `_connect`
        self._solo: set[str] = set()  # dropped with a node group: a group of their own until a push reaches them
        # per replica: its /update_weights call (bounded by its HTTP timeout), and one of a push before it
        self._pool = ThreadPoolExecutor(max_workers=2 * len(urls), thread_name_prefix=f"{wire.transport}-sync")

    @property
    def groups(self) -> list[Members]:
        """The groups formed now, in replica order."""
        return sorted(self._groups, key=lambda m: self._index[m[0]])

    def layout(self, urls: Iterable[str]) -> list[Members]:
        """The groups a push to `urls` goes through: per host (of the URL), its replicas in one
        group, but each replica in `_solo` in a group of its own; in replica order."""
        nodes: dict[str | None, list[str]] = {}
        solo: list[Members] = []
        for url in sorted(urls, key=self._index.__getitem__):
            if url in self._solo:
                solo.append((url,))
            else:
                nodes.setdefault(self._host[url], []).append(url)
        return sorted([tuple(m) for m in nodes.values()] + solo, key=lambda m: self._index[m[0]])

    def forget(self, urls: Iterable[str]) -> None:
        """Destroy every group holding one of `urls` (their other members' next push forms one anew)."""
        gone = set(urls)
        for members in [m for m in self._groups if gone & set(m)]:
            self._groups.pop(members).destroy()

    def _connect(self, members: Members) -> Channel:
        """Form the group of `members` (replicas of one host): each one's init call (its workers at
        ranks 1 + k x replica_tp.., k its place in `members`: vLLM's `rank_offset`) and this end's
        rendezvous, awaited together. A member that refuses (or does not answer) raises
        `GroupNotFormed` naming it, once the other members' inits ended (bounded): their engines
        stay in the rendezvous until its timeout, and must be free when the pool closes their update."""
        errors: dict[str, str] = {}
        for url in members:
            try:
                workers = self._clients[url].world_size()
            except Exception as e:  # noqa: BLE001 - this member's own failure
                errors[url] = repr(e)
                continue
            if workers != self.replica_tp:
                raise WeightSyncError(
                    f"replica {self._index[url]} at {url} has {workers} worker(s) in its weight-transfer group (its TP "
                    f"x PP) but rollout.replica_tp={self.replica_tp}: start it with --tensor-parallel-size "
                    f"{self.replica_tp} or set rollout.replica_tp={workers}")
        if errors:
            raise GroupNotFormed(errors)
        address = self._address[members[0]]
        first = self._index[members[0]]
        port = self.base_port + self.stage * len(self._index) + first if self.base_port else free_port(address)
        world_size = 1 + len(members) * self.replica_tp
        # on daemon threads, not the pool: NCCL's ncclCommInitRank has no timeout, and a thread left
        # inside it must neither take a pool thread for good nor be joined at exit
        joined = {url: on_daemon_thread(self._clients[url].init_weight_transfer,
                                        _vllm_init_info(address, port, world_size, 1 + k * self.replica_tp,
                                                        self.stage, self.bucket_bytes, self.timeout_s))
                  for k, url in enumerate(members)}
        opened = on_daemon_thread(self.wire.open, address, port, world_size, self.timeout_s)
        steps: list[Future[Any]] = [*joined.values(), opened]
        wait(steps, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        refused = {u: repr(f.exception()) for u, f in joined.items() if f.done() and f.exception() is not None}
        if refused:
            _destroy_when_open(opened)
            wait(joined.values(), timeout=self.timeout_s)
            raise GroupNotFormed(refused)
        if opened.done() and (error := opened.exception()) is not None:
            _destroy_when_open(opened)
            raise error
        if not all(step.done() for step in steps):
            _destroy_when_open(opened)
            raise TimeoutError(f"replicas {[self._index[u] for u in members]}: their {self.wire.transport} group of "
                               f"stage {self.stage} did not form within {self.timeout_s:.0f} s")
        return opened.result()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], urls: Sequence[str] | None = None,
             keep: bool = False) -> PushResult:
        """Stream the tensors into the open update of each replica in `urls` (None: all): one
        `/update_weights` per replica, the stage's tensors packed by vLLM's producer and broadcast
        once per group (`layout`). A group is re-formed when its members differ from this push's
        (a replica left out, back, or alone after a failure)."""
        t0 = time.perf_counter()
        failed: dict[str, str] = {}
        live: dict[Members, Channel] = {}
        dropped: list[Members] = []  # groups that failed to form or in the push
        for members in self.layout(list(self._clients) if urls is None else urls):
            try:
                if members not in self._groups:
                    self.forget(members)  # a replica holds one group per stage: the new one replaces its old one
                    self._groups[members] = self._connect(members)
                live[members] = self._groups[members]
            except WeightSyncError:
                raise
            except GroupNotFormed as e:  # reported; its replicas are left out of this push
                failed.update({url: f"forming its {self.wire.transport} group: " + (
                    e.errors.get(url) or f"another member failed ({e})") for url in members})
                dropped.append(members)
            except Exception as e:  # noqa: BLE001 - reported; its replicas are left out of this push
                failed.update(dict.fromkeys(members, f"forming its {self.wire.transport} group: {e!r}"))
                dropped.append(members)
        info = update_info([], keep=keep, group=self.stage)  # the manifest comes in-band, buffer by buffer
        answers = {u: self._pool.submit(self._clients[u].update_weights, info) for members in live for u in members}
        device = torch.device("cuda", torch.cuda.current_device()) if self.wire.transport == "nccl" else torch.device("cpu")
        fanout = Fanout(live, answers, buffer_bytes=self.bucket_bytes, timeout_s=self.timeout_s, keep=keep,
                        group=self.stage, device=device)
        vllm_plugin.packed_tensor().packed_nccl_broadcast_producer(  # drains the stream even with no replica left
            iterator=fanout.items(named_tensors), group=fanout, src=0, post_iter_func=fanout.record,
            buffer_size_bytes=self.bucket_bytes, num_buffers=NUM_BUFFERS)
        fanout.finish()
        for members in fanout.dropped:
            self._groups.pop(members, None)
        failed.update(fanout.failed)
        with_group = [url for members in dropped + fanout.dropped if len(members) > 1 for url in members]
        self._solo = (self._solo | set(with_group)) - {m[0] for m in fanout.channels if len(m) == 1}
        return PushResult(bytes=fanout.bytes, replicas=sum(len(m) for m in fanout.channels), buckets=fanout.buffers,
                          calls=1 if answers else 0, seconds=time.perf_counter() - t0,
                          send_seconds=fanout.wait_seconds, failed=failed, failed_with_group=with_group,
                          carriers=[self.wire.transport])

    def close(self) -> None:
        self.forget(list(self._index))
        for client in self._clients.values():
            client.close()
        self._pool.shutdown(wait=False)


def on_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` on a daemon thread of its own -> its future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="weight-sync-formation", daemon=True).start()
    return future


def _destroy_when_open(opened: Future) -> None:
    """A group whose rendezvous is still running (or done) after the sender gave up on it: ended
    once it forms, so that neither end keeps it."""
    opened.add_done_callback(lambda f: f.result().destroy() if f.exception() is None else None)
