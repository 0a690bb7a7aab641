"""Rollout side: vLLM's own API servers as replicas, the pool that dispatches over them.

Knows HF tensors and policy versions, never Megatron internals. replica.py: how a replica's
server is started and a client for its routes; auth.py: the key every route needs; launcher.py:
servers on this machine, one process group each; supervisor.py: the small process that ends a
server's group when the learner that started it dies; build.py: the run's pool from its config;
pool.py: dispatch, versions, weight-update phases and faults; producer.py: the thread that keeps
the replicas busy.
"""
from megatron_async.rollout.launcher import PoolError
from megatron_async.rollout.pool import ReplicaInfo, ReplicaPool
from megatron_async.rollout.replica import ReplicaClient, ReplicaError, ReplicaSpec, Sampling

__all__ = [
    "PoolError", "ReplicaClient", "ReplicaError", "ReplicaInfo", "ReplicaPool", "ReplicaSpec", "Sampling",
]
