"""vLLM weight-transfer engines `mas_nccl` and `mas_gloo`: the replica's end of weights/broadcast.py.

`mas_nccl` is vLLM's dense NCCL engine (`NCCLWeightTransferEngine`,
vllm/distributed/weight_transfer/nccl_engine.py) with what a long run needs of it:
- a failed bucket aborts the open layerwise reload (`abort_layerwise_reload`). NOTE (vLLM 0.32):
  vLLM's worker ends the update session when `update_weights` raises but leaves the model's
  reload state open, and that replica then never loads weights again (weights/cpu_engine.py);
- the `{"verify": true}` call answers whether the update covered every parameter, as `mas_cpu`
  does (so the pool verifies every sync whatever the transport);
- one group per learner pipeline stage, held side by side (vLLM's engine holds one): each
  stage's sender is rank 0 of its own group, named by `group` (its stage) in the init call and in
  every bucket's `/update_weights`, so a TP x PP learner's stages stream into one update session
  at once (weights/broadcast.py says why this and not the stages in turn);
- a group formed again (a failed push, a re-formed sender) replaces the old one of its stage,
  destroyed, instead of leaking it (vLLM's `init_transfer_engine` overwrites it);
- buckets come unpacked (one broadcast per tensor, vLLM's non-packed mode): the receive loop is
  vLLM's unpacked branch, recording what `load_weights` loaded;
- delta sync (weights/delta.py): with `keep` each received tensor is kept (`DeltaDecoder`), and a
  tensor named `<name>#delta` overwrites the changed elements of the kept one, loaded whole. The
  kept copy is in host memory on a GPU replica too (a received tensor is copied to the host first).

`mas_gloo` is the same class with one change: its group is weights/gloo.py's GlooCommunicator
instead of vLLM's PyNccl one (and so no CUDA stream is passed). Both are registered by our vLLM
plugin (weights/vllm_plugin.py); replicas of `rollout.weight_transport: nccl | gloo` start with
`--weight-transfer-config '{"backend": "mas_nccl" | "mas_gloo"}'`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

from megatron_async.weights.coverage import UpdateCoverage
from megatron_async.weights.cpu_engine import abort_layerwise_reload, refresh_tied_head
from megatron_async.weights.delta import DeltaDecoder
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


class MasNcclEngine(NCCLWeightTransferEngine):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[int, Any] = {}  # learner pipeline stage -> its group (PyNccl or gloo communicator)
        self.coverage = UpdateCoverage()
        self.deltas = DeltaDecoder()  # the weights as last loaded, where the sender sends deltas

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        if init_info.packed:
            raise ValueError(f"{type(self).__name__} receives unpacked buckets (weights/broadcast.py sends them so)")
        if (old := self.groups.pop(init_info.group, None)) is not None:
            old.destroy()
        self.groups[init_info.group] = self.join_group(init_info)

    def join_group(self, init_info: BroadcastInitInfo):
        return worker_init_process_group(init_info, self.parallel_config)

    def start_weight_update(self) -> None:
        self.coverage.start(self.model)
        super().start_weight_update()

    def parse_update_info(self, update_dict: dict) -> BroadcastUpdateInfo:
        if update_dict.get("verify"):
            return BroadcastUpdateInfo(names=[], dtype_names=[], shapes=[], verify=True)
        return super().parse_update_info(update_dict)

    def update_weights(self, update_info: dict) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":  # the base class's wait for the device (none to ask on CPU)
                torch.accelerator.synchronize()
        except BaseException:
            self.coverage.stop()
            abort_layerwise_reload(self.model)
            raise

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        if update_info.verify:
            self.coverage.check()
            return
        if (group := self.groups.get(update_info.group)) is None:
            raise RuntimeError(f"weight transfer group {update_info.group} not formed (groups formed: "
                               f"{sorted(self.groups)}): call init_transfer_engine first")
        stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
        with disable_mtp_completeness_check():
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                group.broadcast(weight, src=0, stream=stream)
                if update_info.keep:  # the received tensor is this engine's own: kept as it is, on the host
                    name, weight = self.deltas.decode(name, weight.cpu(), owned=True)
                self.coverage.record(self.model.load_weights([(name, weight)]))
                del weight

    def finish_weight_update(self) -> None:
        self.coverage.stop()
        super().finish_weight_update()
        refresh_tied_head(self.model)  # a CPU replica's packed head copy; nothing to do on GPU

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.destroy()
        self.groups.clear()


class MasGlooEngine(MasNcclEngine):
    def join_group(self, init_info: BroadcastInitInfo) -> GlooCommunicator:
        # this worker's rank: vLLM's nccl_common.worker_init_process_group computes it so
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        return GlooCommunicator.join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                     GLOO_RECEIVE_TIMEOUT_S)
