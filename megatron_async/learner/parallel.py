"""torch.distributed + megatron parallel_state set-up for a learner launched by torchrun.

    torchrun --nproc-per-node 4 my_learner.py      # then, inside:
    layout = init_parallel(tp=2, pp=2, seed=1234)   # DP = world_size / (tp * pp)
    ...
    destroy_parallel()

Backend: NCCL with one GPU per local rank when CUDA is available, gloo otherwise (and then the
CPU shims of `cpu_shims` are applied). A plain `python script.py` (no torchrun variables) runs as a
world of one.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_async.learner import cpu_shims


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the TP x PP x DP grid."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """Global rank 0: metrics are broadcast to every rank, so rank 0 can log them."""
        return self.rank == 0


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, timeout_minutes: int = 30,
                  device_index: int | None = None) -> ParallelLayout:
    """Initialise torch.distributed from the torchrun environment and megatron's TP/PP/DP groups.

    Seeds python, numpy and torch (offset by PP rank, as Megatron does, so stages differ) and the
    megatron RNG tracker (`model_parallel_cuda_manual_seed`: per-TP-rank streams for dropout in
    tensor-parallel regions). Raises ValueError when tp * pp does not divide the world size.
    `device_index`: this rank's CUDA device (placement.learner_gpus); default LOCAL_RANK.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise RuntimeError("MASTER_PORT is not set: launch the learner with torchrun")
        os.environ["MASTER_PORT"] = str(free_port())
    world_size = int(os.environ["WORLD_SIZE"])
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not a multiple of tp*pp = {tp}*{pp}")

    cuda = torch.cuda.is_available()
    if cuda:
        index = int(os.environ["LOCAL_RANK"]) if device_index is None else device_index
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        cpu_shims.apply()
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=timedelta(minutes=timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=True,  # get_megatron_optimizer asks for the gloo DP groups
    )
    layout = ParallelLayout(
        rank=dist.get_rank(),
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )
    stage_seed = seed + 100 * layout.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)
    return layout


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def from_rank0(obj, group: dist.ProcessGroup):
    """Rank 0's `obj` on every rank of `group` (a gloo group: any picklable object, between our own
    ranks only)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
