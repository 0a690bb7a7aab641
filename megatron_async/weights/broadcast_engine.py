"""vLLM weight-transfer engines `mas_nccl` and `mas_gloo`: the replica's end of weights/broadcast.py.

`mas_nccl` is vLLM's dense NCCL engine (`NCCLWeightTransferEngine`,
vllm/distributed/weight_transfer/nccl_engine.py) with what a long run needs of it, the same as
`mas_cpu` where weights/engine_base.py runs the update (abort on failure, verify, delta decoding,
the tied head), and these of its own:
- one group per learner pipeline stage, held side by side (vLLM's engine holds one): each
  stage's sender is rank 0 of its own group, named by `group` (its stage) in the init call and in
  every bucket's `/update_weights`, so a TP x PP learner's stages stream into one update session
  at once (weights/broadcast.py says why this and not the stages in turn);
- a group formed again (a failed push, a re-formed sender) replaces the old one of its stage,
  destroyed, instead of leaking it (vLLM's `init_transfer_engine` overwrites it);
- buckets come unpacked (one broadcast per tensor, vLLM's non-packed mode): the receive loop is
  vLLM's unpacked branch; with `keep` (delta sync) a received tensor is copied to the host first,
  so that the kept copy is in host memory on a GPU replica too.

`mas_gloo` is the same class with one change: its group is weights/gloo.py's GlooCommunicator
instead of vLLM's PyNccl one (and so no CUDA stream is passed). Both are registered by our vLLM
plugin (weights/vllm_plugin.py); replicas of `rollout.weight_transport: nccl | gloo` start with
`--weight-transfer-config '{"backend": "mas_nccl" | "mas_gloo"}'`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from megatron_async.weights import vllm_plugin
from megatron_async.weights.engine_base import MasEngine
from megatron_async.weights.gloo import GlooCommunicator

# a worker waiting for the sender's next tensor gives up after this (the sender's own deadline,
# rollout.sync_timeout_s, is shorter by default and aborts the group first)
GLOO_RECEIVE_TIMEOUT_S = 600.0


@dataclass(kw_only=True)
class BroadcastInitInfo(NCCLWeightTransferInitInfo):
    group: int = 0  # the learner pipeline stage whose sender is rank 0 of this group


@dataclass
class BroadcastUpdateInfo(NCCLWeightTransferUpdateInfo):
    verify: bool = False  # no bucket: check that the update covered every parameter
    keep: bool = False  # keep what loads: the base of the next delta (weights/delta.py)
    group: int = 0  # the group (learner pipeline stage) the bucket's tensors come over


class MasNcclEngine(MasEngine, NCCLWeightTransferEngine):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[int, Any] = {}  # learner pipeline stage -> its group (PyNccl or gloo communicator)

    # vLLM's engine is generic in its info classes and the NCCL engine fixes them to its own; ours
    # subclass those and `init_info_cls` / `update_info_cls` make vLLM build ours
    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:  # type: ignore[override]  # see above
        if init_info.packed:
            raise ValueError(f"{type(self).__name__} receives unpacked buckets (weights/broadcast.py sends them so)")
        if (old := self.groups.pop(init_info.group, None)) is not None:
            old.destroy()
        self.groups[init_info.group] = self.join_group(init_info)

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
        for group in self.groups.values():
            group.destroy()
        self.groups.clear()


class MasGlooEngine(MasNcclEngine):
    def join_group(self, init_info: BroadcastInitInfo) -> GlooCommunicator:
        # this worker's rank: vLLM's nccl_common.worker_init_process_group computes it so
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError("mas_gloo joins the sender's group: init_info needs master_address and master_port")
        return GlooCommunicator.join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                     GLOO_RECEIVE_TIMEOUT_S)
