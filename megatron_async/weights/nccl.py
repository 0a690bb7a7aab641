"""NCCL transport for weight sync to GPU replicas: one broadcast per bucket, learner GPU -> replica GPUs.

NOT YET RUN: written against vllm 0.32's weight-transfer helpers, but no session so far had a GPU,
so this path has never executed (tests/test_gpu_sync.py is its check, marked `gpu`).

Groups: each pipeline stage's sender (rank 0) forms its own NCCL group with every worker of every
replica (ranks 1..), through vLLM's weight-transfer helpers (`nccl_common.trainer_init` on the
learner, `worker_init_process_group` in the worker extension: a StatelessProcessGroup
rendezvous, then a PyNcclCommunicator), so it never touches the learner's torch.distributed
groups. Per bucket the sender packs the tensors into one flat uint8 device buffer (`pack`), sends
the layout and a `device_checksum` over the control socket, then broadcasts the buffer; each worker
receives into a buffer of its own, verifies the checksum on its GPU, and loads views of it
(`receive`) through the same code as the other transports.

Why not vLLM's `NCCLWeightTransferEngine` itself: it loads whole updates through
`model.load_weights` with no per-bucket checksum and no coverage check, and would bypass the
replica's update protocol (versions, hold-off, failure state) that every transport shares.

Imports of vLLM happen inside the functions: CPU code never imports this module's CUDA parts.
"""
from __future__ import annotations

import torch

from megatron_async.weights.buckets import ST_DTYPES, TORCH_DTYPES, device_checksum

ALIGN = 16  # byte alignment of each tensor in the flat buffer (and of its total length)


def pack(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, list[list]]:
    """One flat uint8 buffer on `device` holding the tensors, and its layout [[name, dtype, shape, offset]]."""
    layout, offset = [], 0
    for name, t in tensors:
        layout.append([name, ST_DTYPES[t.dtype], list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.zeros(max(offset, ALIGN), dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, lo) in zip(tensors, layout):
        n = t.numel() * t.element_size()
        if n:
            buf[lo : lo + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    return buf, layout


def views(buf: torch.Tensor, layout: list[list]) -> dict[str, torch.Tensor]:
    """The tensors of a packed buffer, as views of it."""
    out = {}
    for name, code, shape, lo in layout:
        dtype = TORCH_DTYPES[code]
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = buf[lo : lo + n].view(dtype).view(shape)
    return out


def open_sender_group(address: str, port: int, world_size: int):
    """Learner side: join the stage's group as rank 0 on the current CUDA device (blocks for the workers)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": address, "master_port": port, "world_size": world_size})


def open_worker_group(address: str, port: int, rank_offset: int, world_size: int, parallel_config):
    """Replica worker side: join a stage's group at rank `rank_offset` + the worker's rank."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_process_group

    info = NCCLWeightTransferInitInfo(master_address=address, master_port=port, rank_offset=rank_offset,
                                      world_size=world_size)
    return worker_init_process_group(info, parallel_config)


def receive(comm, layout: list[list], nbytes: int, expected_checksum: int, device) -> dict[str, torch.Tensor]:
    """Replica worker side: receive one bucket's broadcast, verify its checksum, return views of it."""
    from megatron_async.weights.buckets import BucketChecksumError

    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    comm.broadcast(buf, src=0)
    got = device_checksum(buf)
    if got != expected_checksum:
        raise BucketChecksumError(
            f"bucket checksum mismatch: NCCL buffer of {nbytes} bytes has checksum {got:#018x}, "
            f"sender said {expected_checksum:#018x}"
        )
    return views(buf, layout)
