"""Our vLLM weight-transfer engines, the replica's end of every weight sync: `MasEngine`, the update
they all run, then each engine's `receive` (how a bucket arrives): `mas_cpu` (host memory) and
`mas_nccl` / `mas_gloo` (vLLM's NCCL engine, on NCCL or on gloo).

vLLM 0.32's weight-transfer API (init / start / update / finish, reached through the server's
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update` routes) has GPU backends only and no long-run protocol of ours. These
engines plug into it through vLLM's public extension point,
`WeightTransferEngineFactory.register_engine`, called by our vLLM general plugin
(weights/vllm_plugin.py, which vLLM loads in every one of its processes, the worker included); a
server started with `--weight-transfer-config '{"backend": "mas_cpu" | "mas_nccl" | "mas_gloo"}'`
builds one in its worker. Why an engine and not a worker extension reached by `/collective_rpc`:
the engine is what vLLM's own phases drive (the worker tracks the session, `finish_weight_update`
sets `weight_version`, the metrics of the RL routes count it), and `/collective_rpc` needs more of
the dev-mode surface.

The update, the same for every transport (`MasEngine`):
- start: record the model's parameters (`UpdateCoverage`), then vLLM's layerwise reload begins;
- each bucket (`update_weights`): the `{"verify": true}` call answers whether the update covered
  every parameter (a sync replaces every weight or is reported failed); any other bucket is the
  engine's `receive`, which hands its tensors to `load`: with `keep` (delta sync,
  weights/delta.py) through the engine's `DeltaDecoder`, whose kept copy is the next delta's base;
  every name `load_weights` returns is recorded;
- a bucket that fails (a bad checksum, a dead group, a delta without a base) ends the update:
  vLLM's worker closes its session, and the layers still waiting for weights are restored as they
  were (`vllm_plugin.abort_reload`), so that a later full update starts clean;
- finish: vLLM's layerwise reload is finalized, then a tied `lm_head` is re-packed from the new
  embedding (`vllm_plugin.refresh_tied_head`).
`verify` is an update call, not part of finish, because a failing `update_weights` closes vLLM's
update session while a failing `finish_weight_update` leaves it open, and no later update could
start. Every touch of vLLM's internals is weights/vllm_plugin.py's (checked against its version).

`mas_cpu` (`CpuWeightTransferEngine`, the CPU counterpart of vLLM's `nccl` / `ipc` backends): one
`update_weights` call carries one bucket (weights/host_memory.py: a safetensors payload of
HF-named tensors with its CRC32), by one of two carriers:
- `{"shm": "/dev/shm/mas-wsync-...", "size": n, "checksum": c, "sample_offset": o}`: a shared-
  memory segment the sender on the same host wrote; the bytes never cross a socket;
  `sample_offset` (or None: full) is the checksum's scope;
- `{"data": "<base64>", "checksum": c}`: the bytes inline in the JSON body, for a replica on
  another host. JSON and safetensors only: nothing is unpickled.
A bucket is verified before anything from it is loaded. Its tensors are loaded straight from the
carrier, with no copy; when `load_weights` returns, whatever vLLM's layerwise reload still holds
from a shm segment (the weights of a layer that the next bucket completes) is copied out
(`vllm_plugin.detach_buffered`): the sender rewrites a segment two buckets later. An http payload
is this call's own bytes: nothing to copy. With `keep` (delta sync) the kept copies are the
engine's own memory: nothing of the segment stays referenced, so there is nothing to copy out.

`mas_nccl` (`MasNcclEngine`) is vLLM's dense NCCL engine (`NCCLWeightTransferEngine`,
vllm/distributed/weight_transfer/nccl_engine.py), the replica's end of weights/broadcast.py, with
what a long run needs of it:
- one group per learner pipeline stage, held side by side (vLLM's engine holds one): each
  stage's sender is rank 0 of its own group, named by `group` (its stage) in the init call and in
  every bucket's `/update_weights`, so a TP x PP learner's stages stream into one update session
  at once (weights/broadcast.py says why this and not the stages in turn);
- a group formed again (a failed push, a re-formed sender) replaces the old one of its stage,
  destroyed, instead of leaking it (vLLM's `init_transfer_engine` overwrites it);
- a stage's push is one `update_weights` received by vLLM's `packed_nccl_broadcast_consumer`, its
  manifest read in-band from the header before each buffer (`inband_manifest`; a group formed
  with packed=False is received as vLLM's unpacked mode, one broadcast per tensor); with `keep`
  (delta sync) a received tensor is copied to the host first, so that the kept copy is in host
  memory on a GPU replica too;
- the receive is bounded: a gloo group's timeout is the sender's sync timeout (`timeout_s` in the
  init call), and on CUDA a `Watchdog` aborts the group after it without progress; a receive that
  fails drops its group (the sender's next push forms it again), so the engine is never wedged.
`mas_gloo` (`MasGlooEngine`) is the same class with one change: its group is weights/broadcast.py's
`GlooCommunicator` instead of vLLM's PyNccl one (and so no CUDA stream is passed).
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, cast

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from megatron_async.weights import vllm_plugin
from megatron_async.weights.broadcast import GlooCommunicator
from megatron_async.weights.delta import DeltaDecoder
from megatron_async.weights.host_memory import open_segment, unpack_bucket

# NOTE: finalize_layerwise_reload warns "Failed to load weights" for a layer no bucket touched;
# the verify call checks coverage itself and fails loudly instead.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


class UpdateCoverage:
    """Which model parameters an open weight update has loaded."""

    def __init__(self) -> None:
        self._expected: set[str] = set()  # the model's parameter names (vLLM's), taken at start
        self._loaded: set[str] | None = None  # those loaded so far; None outside an update

    def start(self, model: torch.nn.Module) -> None:
        """Call before vLLM's `initialize_layerwise_reload`. NOTE: that reload puts each layer's
        tensors on the meta device one layer at a time, so a tied lm_head gets a meta weight of its
        own and `named_parameters` lists `lm_head.weight`, which no update sends (measured: every
        sync of a tied model failed the check). Before it, the tied head is the embedding."""
        self._expected = {name for name, _ in model.named_parameters()}
        self._loaded = set()

    @property
    def is_open(self) -> bool:
        """An update is open: between `start` and `stop`."""
        return self._loaded is not None

    def record(self, loaded: Iterable[str] | None) -> None:
        """What one `model.load_weights` call returned (the parameters it loaded)."""
        if self._loaded is None:
            raise RuntimeError("update_weights before start_weight_update")
        self._loaded |= set(loaded or ())

    def check(self) -> None:
        """Raise unless every parameter was loaded in this update."""
        if self._loaded is None:
            raise RuntimeError("verify before start_weight_update")
        if missing := sorted(self._expected - self._loaded):
            raise RuntimeError(f"weight update incomplete: {len(missing)} of {len(self._expected)} parameters not sent, "
                               f"e.g. {missing[:5]}")

    def stop(self) -> None:
        self._loaded = None


class MasEngine:
    """The shared part of our engines; listed before vLLM's engine class in theirs (it overrides
    vLLM's start / update / finish). Set by vLLM's constructor: `model`, `model_config`, `device`."""

    model: torch.nn.Module
    model_config: Any
    device: torch.device

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_plugin.require_vllm()  # before anything of it is touched: a clear error on another vLLM
        super().__init__(*args, **kwargs)
        self.coverage = UpdateCoverage()  # which parameters the open update loaded
        self.deltas = DeltaDecoder()  # the weights as last loaded, where the sender sends deltas

    def start_weight_update(self) -> None:
        self.coverage.start(self.model)  # before the reload (UpdateCoverage.start says why)
        vllm_plugin.start_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # NOTE: instead of the base class's unconditional `torch.accelerator.synchronize()`, which
        # has nothing to wait for on CPU and no accelerator to ask there
        try:
            self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]  # vLLM's engine class, after this one in the MRO
            if self.device.type != "cpu":
                torch.accelerator.synchronize()
        except BaseException:
            self.coverage.stop()
            vllm_plugin.abort_reload(self.model)
            raise

    def receive_weights(self, update_info: Any) -> None:
        if not self.coverage.is_open:
            raise RuntimeError("update_weights before start_weight_update")
        if update_info.verify:
            self.coverage.check()
            return
        self.receive(update_info)

    def receive(self, update_info: Any) -> None:
        """One bucket: its tensors, however they come, into `load`."""
        raise NotImplementedError

    def load(self, named: Iterable[tuple[str, torch.Tensor]], keep: bool, owned: bool = False) -> None:
        """`model.load_weights` of (wire name, tensor) pairs; with `keep`, each decoded and kept
        first (a copy unless `owned`: a carrier's memory is the sender's to rewrite)."""
        if keep:
            named = [self.deltas.decode(name, tensor, owned) for name, tensor in named]
        self.coverage.record(self.model.load_weights(named))  # type: ignore[operator]  # vLLM's model method, typed by nn.Module as a Tensor or Module

    def finish_weight_update(self) -> None:
        self.coverage.stop()
        vllm_plugin.finish_reload(self.model, self.model_config)
        vllm_plugin.refresh_tied_head(self.model)  # a CPU replica's packed head copy; nothing to do on GPU

    def shutdown(self) -> None:
        self.coverage.stop()


# ----------------------------------------------------------------------------- mas_cpu: host memory


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the carrier is named per bucket."""


@dataclass
class CpuUpdateInfo(WeightTransferUpdateInfo):
    checksum: int = 0  # CRC32 of the bucket's payload ...
    sample_offset: int | None = None  # ... sampled from here (weights/host_memory.py); None: of every byte
    shm: str | None = None  # a /dev/shm/mas-wsync-* segment on this host ...
    size: int = 0  # ... and the bucket's length in it
    data: str | None = None  # or the payload, base64
    keep: bool = False  # keep a copy of what loads: the base of the next delta (weights/delta.py)
    verify: bool = False  # no bucket: check that the update covered every parameter

    def __post_init__(self) -> None:
        if not self.verify and (self.shm is None) == (self.data is None):
            raise ValueError("update_info needs exactly one of 'shm' (with 'size') or 'data', or 'verify'")


class CpuWeightTransferEngine(MasEngine, WeightTransferEngine[CpuInitInfo, CpuUpdateInfo]):
    init_info_cls = CpuInitInfo
    update_info_cls = CpuUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: CpuInitInfo) -> None:
        pass

    def receive(self, update_info: CpuUpdateInfo) -> None:
        if update_info.shm is not None:
            mapping = open_segment(update_info.shm)
            if update_info.size > len(mapping):
                raise ValueError(f"bucket of {update_info.size} bytes overruns segment {update_info.shm} ({len(mapping)} bytes)")
            payload: bytes | memoryview = memoryview(mapping)[: update_info.size]
        else:
            payload = base64.b64decode(update_info.data or "")
        tensors = unpack_bucket(payload, update_info.checksum, update_info.sample_offset)
        self.load(iter(tensors.items()), keep=update_info.keep)
        if update_info.shm is not None and not update_info.keep:  # the sender rewrites the segment two buckets later
            vllm_plugin.detach_buffered(tensors.values())


# ----------------------------------------------------------------------------- mas_nccl, mas_gloo: a broadcast


@dataclass(kw_only=True)
class BroadcastInitInfo(NCCLWeightTransferInitInfo):
    group: int = 0  # the learner pipeline stage whose sender is rank 0 of this group
    timeout_s: float = 300.0  # bounds each wait of the receive for the sender (its rollout.sync_timeout_s)


@dataclass
class BroadcastUpdateInfo(NCCLWeightTransferUpdateInfo):
    verify: bool = False  # no bucket: check that the update covered every parameter
    keep: bool = False  # keep what loads: the base of the next delta (weights/delta.py)
    group: int = 0  # the group (learner pipeline stage) the tensors come over


def inband_manifest(group: Any, device: torch.device,
                    kick: Callable[[], None]) -> Iterator[tuple[str, tuple[list[int], torch.dtype]]]:
    """The manifest vLLM's packed consumer iterates, read from the headers the sender broadcasts
    before each buffer (weights/broadcast.py `header_tensors`): a JSON length, then the JSON of
    the buffer's names, dtypes, shapes and whether it is the last; a length of 0 ends the stream."""
    while True:
        length = torch.empty(1, dtype=torch.int64, device=device)
        group.broadcast(length, src=0)
        kick()
        if (size := int(length.item())) == 0:
            return
        raw = torch.empty(size, dtype=torch.uint8, device=device)
        group.broadcast(raw, src=0)
        header = json.loads(raw.cpu().numpy().tobytes())
        for name, dtype_name, shape in zip(header["names"], header["dtype_names"], header["shapes"], strict=True):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"weight header names an unknown dtype {dtype_name!r} for {name}")
            yield name, (shape, dtype)
        if header["last"]:
            return


class Watchdog:
    """Destroys `group` when the receive made no progress (`kick`) for `timeout_s`: a PyNccl
    broadcast has no timeout, and a replica whose sender went away would stay inside it for good."""

    def __init__(self, group: Any, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.fired = False
        self._last = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="weight-receive-watchdog", daemon=True).start()

    def kick(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s)):
            if time.monotonic() - self._last > self.timeout_s:
                self.fired = True
                self.group.destroy()  # ncclCommAbort: ends the broadcast kernels waiting for the sender
                return


class MasNcclEngine(MasEngine, NCCLWeightTransferEngine):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[int, Any] = {}  # learner pipeline stage -> its group (PyNccl or gloo communicator)
        self.group_infos: dict[int, BroadcastInitInfo] = {}  # ... and how it was formed (packed, timeout)

    # vLLM's engine is generic in its info classes and the NCCL engine fixes them to its own; ours
    # subclass those and `init_info_cls` / `update_info_cls` make vLLM build ours
    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:  # type: ignore[override]  # see above
        self.drop_group(init_info.group)
        self.groups[init_info.group] = self.join_group(init_info)
        self.group_infos[init_info.group] = init_info

    def drop_group(self, group: int) -> None:
        """Abort and forget `group` (re-formed by the sender's next init)."""
        self.group_infos.pop(group, None)
        if (old := self.groups.pop(group, None)) is not None:
            old.destroy()

    def join_group(self, init_info: BroadcastInitInfo) -> Any:
        return worker_init_process_group(init_info, self.parallel_config)

    def parse_update_info(self, update_dict: dict) -> BroadcastUpdateInfo:
        if update_dict.get("verify"):
            return BroadcastUpdateInfo(names=[], dtype_names=[], shapes=[], verify=True)
        return cast(BroadcastUpdateInfo, super().parse_update_info(update_dict))  # built from update_info_cls

    def receive(self, update_info: BroadcastUpdateInfo) -> None:
        if (group := self.groups.get(update_info.group)) is None:
            raise RuntimeError(f"weight transfer group {update_info.group} not formed (groups formed: "
                               f"{sorted(self.groups)}): call init_transfer_engine first")
        init = self.group_infos[update_info.group]
        try:
            if init.packed:
                self.receive_packed(group, init, update_info.keep)
            else:
                self.receive_unpacked(group, update_info)
        except BaseException:
            # the group has broadcasts this end will never read (or a dead peer): aborted here, so that
            # the engine is free at once and the sender's next push forms it again
            self.drop_group(update_info.group)
            raise

    def receive_packed(self, group: Any, init: BroadcastInitInfo, keep: bool) -> None:
        """vLLM's packed consumer, its manifest in-band (`inband_manifest`). Bounded: on gloo each
        wait by the group's timeout (init.timeout_s; a sender that went away fails it at once);
        on CUDA by a `Watchdog` over the same timeout."""
        watchdog = Watchdog(group, init.timeout_s) if self.device.type == "cuda" else None
        kick = watchdog.kick if watchdog is not None else (lambda: None)

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            # views of a packed buffer the consumer never rewrites (it allocates each anew);
            # kept (delta sync) on the host
            self.load([(name, t.cpu() if keep else t) for name, t in named], keep=keep, owned=True)
            kick()

        try:
            vllm_plugin.packed_tensor().packed_nccl_broadcast_consumer(
                iterator=inband_manifest(group, self.device, kick), group=group, src=0, post_unpack_func=load,
                buffer_size_bytes=init.packed_buffer_size_bytes, num_buffers=init.packed_num_buffers, device=self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            if watchdog is not None:
                watchdog.stop()
        if watchdog is not None and watchdog.fired:
            raise TimeoutError(f"weight receive made no progress for {init.timeout_s:.0f} s: group aborted")

    def receive_unpacked(self, group: Any, update_info: BroadcastUpdateInfo) -> None:
        """vLLM's unpacked mode (a group formed with packed=False): the manifest in the call, one
        broadcast per tensor."""
        stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
        with vllm_plugin.tensor_by_tensor_loading():
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                group.broadcast(weight, src=0, stream=stream)
                # kept on the host; the received tensor is this engine's own
                self.load([(name, weight.cpu() if update_info.keep else weight)], keep=update_info.keep, owned=True)
                del weight

    def shutdown(self) -> None:
        super().shutdown()
        for group in list(self.groups):
            self.drop_group(group)


class MasGlooEngine(MasNcclEngine):
    def join_group(self, init_info: BroadcastInitInfo) -> GlooCommunicator:
        # this worker's rank: vLLM's nccl_common.worker_init_process_group computes it so
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError("mas_gloo joins the sender's group: init_info needs master_address and master_port")
        return GlooCommunicator.join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                     init_info.timeout_s)
