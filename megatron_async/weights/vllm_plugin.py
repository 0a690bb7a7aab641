"""Our vLLM general plugin: registers the `mas_cpu` weight-transfer engine (weights/cpu_engine.py).

vLLM runs every plugin of the entry-point group `vllm.general_plugins` (declared in setup.py) in
each of its processes before it builds an engine, so a replica's worker finds the backend by name
(`--weight-transfer-config '{"backend": "mas_cpu"}'`). Registration is lazy (a module path), so
the plugin costs nothing in processes that never build the engine.
"""
from __future__ import annotations

BACKEND = "mas_cpu"  # the name replicas are started with and the sender checks


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # vLLM may load plugins more than once
        WeightTransferEngineFactory.register_engine(BACKEND, "megatron_async.weights.cpu_engine", "CpuWeightTransferEngine")
