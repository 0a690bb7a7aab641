"""A gloo process group with the calls vLLM's NCCL weight-transfer engine makes on its PyNccl
communicator (`broadcast(tensor, src, stream)`, `destroy()`), plus the sender's non-blocking end.

Both ends of `rollout.weight_transport: gloo` use it: the learner's sender (weights/broadcast.py,
rank 0) and the replica's `mas_gloo` engine (weights/broadcast_engine.py, ranks 1..W-1), so that
the rest of the NCCL path, ours and vLLM's, runs unchanged over TCP. The group is vLLM's own
stateless one (`vllm_plugin.stateless_gloo_group`: a TCP store rendezvous at the
sender, no global torch.distributed state), so it lives beside the learner's process groups.

Gloo moves CPU tensors: a CUDA tensor is staged through host memory on either end.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable, Sequence

import torch

from megatron_async.weights import vllm_plugin


class GlooCommunicator:
    def __init__(self, group: torch.distributed.ProcessGroup):
        self.group = group
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

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        """PyNccl's blocking broadcast (`stream` is a CUDA stream there; gloo has none)."""
        staged = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        if staged is not tensor and self.group.rank() == src:
            staged.copy_(tensor)
        self.group.broadcast(staged, src).wait()
        if staged is not tensor:
            tensor.copy_(staged)

    def send(self, tensors: Sequence[torch.Tensor]) -> Callable[[], bool]:
        """Rank 0: start broadcasting `tensors` in order and return at once; the returned poll is
        True once all were sent, and raises if the group failed (a peer closed it or timed out)."""
        works = [self.group.broadcast(t.detach().to("cpu").contiguous(), 0) for t in tensors]
        self._in_flight = works

        def sent() -> bool:
            if not all(w.is_completed() for w in works):
                return False
            for w in works:
                w.wait()  # raises the failure of a completed-with-error broadcast
            return True
        return sent

    def destroy(self) -> None:
        """End the group without blocking. NOTE (torch 2.13): gloo's `abort()` does not interrupt a
        send to a peer that stopped reading, and dropping the group then blocks until the group's
        timeout (measured: 19 s of a 20 s timeout); a daemon thread waits that out instead."""
        group, pending = self.group, [w for w in self._in_flight if not w.is_completed()]
        self._in_flight = []
        group.abort()
        if not pending:
            return

        def release() -> None:  # holds the group until its broadcasts ended
            for w in pending:
                try:
                    w.wait()
                except RuntimeError:  # the peer closed it, or the group's timeout fired
                    pass

        threading.Thread(target=release, name="gloo-release", daemon=True).start()
