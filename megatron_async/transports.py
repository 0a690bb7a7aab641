"""The weight transports `rollout.weight_transport` names, in one table, and their rules.

    TRANSPORTS["gloo"].engine      # "mas_gloo": the vLLM weight-transfer engine its replicas run
    carrier_for("auto", "http://127.0.0.1:8000")   # "shm": the host-memory carrier for one replica

The config check (config.validate), the run plan (run_plan.py: what `auto` means on this
machine), the learner's senders (weights/build.py, weights/host_memory.py) and the replicas' engine
(rollout/build.py, weights/vllm_plugin.py) all read this table: each rule is written here once.
A leaf: it imports nothing of the project, so every side may import it (a replica's vLLM worker too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

WeightTransport = Literal["auto", "shm", "http", "nccl", "gloo"]  # rollout.weight_transport
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})  # a host only this machine reaches
HOST_MEMORY_ENGINE = "mas_cpu"  # weights/engines.py's CpuWeightTransferEngine


@dataclass(frozen=True)
class Transport:
    """One `rollout.weight_transport` value and what it implies."""
    name: str
    engine: str  # the vLLM weight-transfer engine the replicas run (registered by weights/vllm_plugin.py)
    broadcast: bool  # weights/broadcast.py's sender (process groups); else weights/host_memory.py's
    delta: bool  # delta sync (rollout.sync_full_every >= 2, weights/delta.py) is built for it
    loopback_only: bool  # the replicas must be on the learner's host
    auto_bucket_mb: int  # rollout.sync_bucket_mb auto: vLLM's packed buffer, or one bucket per call


TRANSPORTS = {t.name: t for t in (
    Transport("auto", HOST_MEMORY_ENGINE, broadcast=False, delta=True, loopback_only=False, auto_bucket_mb=64),
    Transport("shm", HOST_MEMORY_ENGINE, broadcast=False, delta=True, loopback_only=True, auto_bucket_mb=64),
    Transport("http", HOST_MEMORY_ENGINE, broadcast=False, delta=True, loopback_only=False, auto_bucket_mb=64),
    Transport("nccl", "mas_nccl", broadcast=True, delta=False, loopback_only=False, auto_bucket_mb=1024),
    Transport("gloo", "mas_gloo", broadcast=True, delta=True, loopback_only=False, auto_bucket_mb=1024),
)}
BROADCAST_TRANSPORTS = tuple(name for name, t in TRANSPORTS.items() if t.broadcast)


def weight_engine(transport: str) -> str:
    """The engine replicas run for a transport (as the run plan resolves it)."""
    return TRANSPORTS[transport].engine


def sync_bucket_bytes(setting: int | str, transport: str) -> int:
    """rollout.sync_bucket_mb -> bytes: auto is vLLM's packed buffer (1 GiB) over nccl / gloo, where
    the buffers of a stage go in one call, and 64 MiB over shm / http, one call per bucket."""
    if setting != "auto":
        return int(setting) << 20
    return TRANSPORTS[transport].auto_bucket_mb << 20


def carrier_for(transport: str, url: str) -> str:
    """The host-memory carrier for the replica at `url`: `auto` is shm for a loopback address, else
    http. Raises ValueError for a transport that is not host memory or cannot reach the replica."""
    host = urlparse(url).hostname
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if TRANSPORTS[transport].broadcast:
        raise ValueError(f"rollout.weight_transport={transport} is weights/broadcast.BroadcastSender's, not this sender's")
    if transport == "auto":
        return "shm" if host in LOOPBACK_HOSTS else "http"
    if TRANSPORTS[transport].loopback_only and host not in LOOPBACK_HOSTS:
        raise ValueError(f"rollout.weight_transport={transport} needs replicas on this host; replica at {url} is not "
                         f"loopback (use auto or http)")
    return transport
