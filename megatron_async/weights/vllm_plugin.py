"""Our vLLM general plugin: registers our weight-transfer engines in vLLM's factory.

- `mas_cpu` (weights/cpu_engine.py): host-memory buckets (shm or inline), CPU and GPU replicas;
- `mas_nccl`, `mas_gloo` (weights/broadcast_engine.py): vLLM's NCCL engine, on NCCL or on gloo.

vLLM runs every plugin of the entry-point group `vllm.general_plugins` (declared in setup.py) in
each of its processes before it builds an engine, so a replica's worker finds the backend by name
(`--weight-transfer-config '{"backend": "mas_cpu"}'`). Registration is lazy (a module path), so
the plugin costs nothing in processes that never build the engine.
"""
from __future__ import annotations

BACKEND = "mas_cpu"  # the host-memory engine: what replicas start with unless the transport broadcasts
BROADCAST_BACKENDS = {"nccl": "mas_nccl", "gloo": "mas_gloo"}  # rollout.weight_transport -> engine
ENGINES = {BACKEND: ("megatron_async.weights.cpu_engine", "CpuWeightTransferEngine"),
           "mas_nccl": ("megatron_async.weights.broadcast_engine", "MasNcclEngine"),
           "mas_gloo": ("megatron_async.weights.broadcast_engine", "MasGlooEngine")}


def backend_for(transport: str) -> str:
    """The engine replicas run for `rollout.weight_transport`."""
    return BROADCAST_BACKENDS.get(transport, BACKEND)


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, (module, cls) in ENGINES.items():
        if name not in WeightTransferEngineFactory._registry:  # vLLM may load plugins more than once
            WeightTransferEngineFactory.register_engine(name, module, cls)
