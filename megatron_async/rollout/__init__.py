"""Rollout side: vLLM replicas in their own processes, the pool that dispatches over them.

Knows HF tensors and policy versions, never Megatron internals. See pool.py for dispatch and
fault handling, replica.py for the replica protocol and the weight-update invariants, host.py for
`serve-replicas`, which starts a dedicated replica node's replicas for the pool.
"""
from megatron_async.rollout.launcher import PoolError
from megatron_async.rollout.pool import Completion, ReplicaInfo, ReplicaPool
from megatron_async.rollout.replica import ReplicaClient, ReplicaError, ReplicaSpec, Sampling

__all__ = [
    "Completion", "PoolError", "ReplicaClient", "ReplicaError", "ReplicaInfo", "ReplicaPool", "ReplicaSpec", "Sampling",
]
