"""vLLM weight-transfer engine `mas_cpu`: the CPU counterpart of vLLM's `nccl` / `ipc` backends.

vLLM 0.32's weight-transfer API (init / start / update / finish, reached through the server's
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update` routes) has GPU backends only. This engine plugs into it through vLLM's
public extension point, `WeightTransferEngineFactory.register_engine`, called by our vLLM general
plugin (`megatron_async.weights.vllm_plugin`, entry point group `vllm.general_plugins`, which
vLLM loads in every one of its processes, the worker included). A server started with
`--weight-transfer-config '{"backend": "mas_cpu"}'` then builds it in its worker.

Why an engine and not a worker extension reached by `/collective_rpc`: the engine is what vLLM's
own phases drive (the worker tracks the session, `finish_weight_update` sets `weight_version`,
the metrics of the RL routes count it), and `/collective_rpc` needs more of the dev-mode surface.

One `update_weights` call carries one bucket (weights/buckets.py: a safetensors payload of
HF-named tensors with its CRC32), by one of two carriers:
- `{"shm": "/dev/shm/mas-wsync-...", "size": n, "checksum": c, "sample_offset": o}`: a shared-
  memory segment the sender on the same host wrote (weights/shm.py); the bytes never cross a
  socket; `sample_offset` (or None: full) is the checksum's scope (weights/buckets.py);
- `{"data": "<base64>", "checksum": c}`: the bytes inline in the JSON body, for a replica on
  another host. JSON and safetensors only: nothing is unpickled.

Per update (start -> update* -> finish), the same as vLLM's checkpoint-format IPC engine, run by
weights/engine_base.py (coverage, verify, abort on failure, delta decoding, the tied head); this
engine supplies only how a bucket arrives (`receive`):
- a bucket is verified before anything from it is loaded. Its tensors are loaded straight from
  the carrier, with no copy; when `load_weights` returns, whatever vLLM's layerwise reload still
  holds from a shm segment (the weights of a layer that the next bucket completes) is copied out
  (`vllm_plugin.detach_buffered`): the sender rewrites a segment two buckets later. An http
  payload is this call's own bytes: nothing to copy. With `keep` (delta sync) the kept copies are
  the engine's own memory: nothing of the segment stays referenced, so there is nothing to copy out.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from megatron_async.weights import vllm_plugin
from megatron_async.weights.buckets import unpack_bucket
from megatron_async.weights.engine_base import MasEngine
from megatron_async.weights.shm import open_segment


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the carrier is named per bucket."""


@dataclass
class CpuUpdateInfo(WeightTransferUpdateInfo):
    checksum: int = 0  # CRC32 of the bucket's payload ...
    sample_offset: int | None = None  # ... sampled from here (weights/buckets.py); None: of every byte
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
