"""Placement: which node runs the vLLM replicas, and which GPUs the learner ranks and replicas use.

Two layouts (see docs/multi-node.md and docs/scaling.md). Either way torchrun starts the learner
ranks with a *static* rendezvous (`--nnodes --node-rank --master-addr`), global rank 0 owns the
`ReplicaPool` and the rollout producer, and the replicas serve over TCP.

- Shared replica node (default): replicas are subprocesses of global rank 0, so they run on node 0
  (`placement.replica_node` must be 0). Node 0's GPUs are split: `placement.replica_gpus` for the
  replicas (`rollout.replica_tp` consecutive ids each, vLLM's own tensor parallelism),
  `placement.learner_gpus` for the learner ranks; other nodes give all their GPUs (or
  `learner_gpus`) to the learner, so node 0 may run fewer learner ranks (torchrun allows that).
- Dedicated replica node (`placement.dedicated_replica_node: true`): node `replica_node` (any) runs
  no learner ranks; `megatron-async serve-replica CFG --index i` there runs replica i's vLLM server
  on `replica_gpus` at `rollout.host:rollout.base_port + i`, and rank 0's pool uses those URLs.
  torchrun spans the other nnodes - 1 nodes: its --node-rank counts learner nodes only (placement
  node n > replica_node is torchrun node n - 1). Needs `rollout.token` (two processes share it).
- `megatron-async placement --node-rank N` prints each node's `--nproc-per-node` (0 on a dedicated
  replica node) and torchrun node rank for the launch scripts.
- Learner local rank i uses `learner(node)[i]`; replica j gets `CUDA_VISIBLE_DEVICES` = its ids.
  Ids are CUDA indices as this process sees them (i.e. within CUDA_VISIBLE_DEVICES if the launcher
  set it); replica ids are translated back to the parent's CUDA_VISIBLE_DEVICES entries.
- Weight sync connects from each pipeline stage's source rank (TP rank 0, DP rank 0) to every
  replica. If such a rank is on another node, the replicas must bind a routable `rollout.host`
  (which requires `rollout.token`); loopback works only when all senders share the replica node,
  i.e. never with a dedicated replica node on real nodes.

Without CUDA, GPU lists are ignored (the CPU test runs two "nodes" on one machine); there
`cpu_plan` splits the CPUs between the learner ranks and the replicas where parallel.learner_cpus
and rollout.replica_cpus are "auto" (cluster/cpu_affinity.py's `plan_cpus`; on the replica node
only: other nodes' learner ranks keep every CPU).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from megatron_async.cluster.cpu_affinity import CpuPlan, plan_cpus
from megatron_async.config import Config, ConfigError
from megatron_async.transports import LOOPBACK_HOSTS


@dataclass(frozen=True)
class NodeLayout:
    learner: list[int]  # CUDA ids; learner local rank i -> learner[i]
    replicas: list[list[int]]  # per replica: its rollout.replica_tp CUDA ids (empty off the replica node)


def _ids(cfg: Config, key: str) -> list[int] | None:
    """The id list of placement.<key>, or None for "auto" (checked on load: config.validate)."""
    value = getattr(cfg.placement, key)
    return None if value == "auto" else list(value)


def node_layout(cfg: Config, node_rank: int, gpus_on_node: int) -> NodeLayout:
    """The GPU split of node `node_rank`, which has `gpus_on_node` GPUs. Raises ConfigError."""
    p, r = cfg.placement, cfg.rollout
    need = r.num_replicas * r.replica_tp
    learner, replica = _ids(cfg, "learner_gpus"), _ids(cfg, "replica_gpus")
    for key, ids in (("placement.learner_gpus", learner), ("placement.replica_gpus", replica)):
        if ids is not None and max(ids) >= gpus_on_node:
            raise ConfigError(f"key '{key}' = {ids}: node {node_rank} has only {gpus_on_node} GPUs (ids 0..{gpus_on_node - 1})")
    if node_rank == p.replica_node:
        what = f"key 'rollout.num_replicas' = {r.num_replicas}: num_replicas x replica_tp = {need}"
        if need > gpus_on_node:
            raise ConfigError(f"{what} exceeds node {node_rank}'s {gpus_on_node} GPUs")
        if need == gpus_on_node and not p.dedicated_replica_node:
            raise ConfigError(f"{what} leaves none of node {node_rank}'s {gpus_on_node} GPUs for learner rank 0, whose "
                              "subprocesses the replicas are (placement.dedicated_replica_node=true runs them alone)")
        replica = (replica or list(range(gpus_on_node - need, gpus_on_node)))[:need]  # auto: the node's last GPUs
        groups = [replica[i * r.replica_tp:(i + 1) * r.replica_tp] for i in range(r.num_replicas)]
        if p.dedicated_replica_node:
            return NodeLayout(learner=[], replicas=groups)
        if learner is None:
            learner = [g for g in range(gpus_on_node) if g not in replica]
        elif set(learner) & set(replica):
            raise ConfigError(f"key 'placement.learner_gpus' = {learner}: overlaps the replica GPUs {replica} on node {node_rank}")
    else:
        learner, groups = (learner if learner is not None else list(range(gpus_on_node))), []
    return NodeLayout(learner=learner, replicas=groups)


def check_fit(cfg: Config, gpus_on_node: int, world_size: int | None) -> list[NodeLayout]:
    """All nodes' layouts; checks the learner rank count and where the weight-sync senders sit."""
    p, par = cfg.placement, cfg.parallel
    layouts = [node_layout(cfg, n, gpus_on_node) for n in range(p.nnodes)]
    ranks = [len(lay.learner) for lay in layouts]
    total = sum(ranks)
    if world_size and world_size != total:
        raise ConfigError(
            f"key 'parallel.world_size' = {world_size}: the placement gives {' + '.join(map(str, ranks))} = {total} "
            f"learner GPUs over placement.nnodes={p.nnodes} (placement.learner_gpus={p.learner_gpus!r}, "
            f"replica_gpus={p.replica_gpus!r}, gpus_per_node={gpus_on_node})")
    if total % (par.tp * par.pp):
        raise ConfigError(
            f"key 'placement.learner_gpus' = {p.learner_gpus!r}: {total} learner GPUs in all is not a multiple of "
            f"parallel.tp x parallel.pp = {par.tp * par.pp}")
    if cfg.rollout.host in LOOPBACK_HOSTS:
        for stage, (sender, node) in enumerate(weight_senders(cfg, layouts)):
            if node != p.replica_node:
                raise ConfigError(
                    f"key 'rollout.host' = {cfg.rollout.host!r}: the weight-sync sender of pipeline stage {stage} "
                    f"(rank {sender}) is on node {node}, but loopback replicas on node {p.replica_node} "
                    f"are unreachable from there: set rollout.host to node {p.replica_node}'s address on the job network "
                    "(and rollout.token)")
    return layouts


def weight_senders(cfg: Config, layouts: list[NodeLayout]) -> list[tuple[int, int]]:
    """(global rank, node) of each pipeline stage's weight-sync sender, its TP rank 0 of DP rank 0:
    ranks fill the nodes in order, and in megatron's rank order (tp-cp-ep-dp-pp) pp varies slowest."""
    node_of_rank = [n for n, lay in enumerate(layouts) for _ in lay.learner]
    per_stage = len(node_of_rank) // cfg.parallel.pp
    return [(stage * per_stage, node_of_rank[stage * per_stage]) for stage in range(cfg.parallel.pp)]


def nproc_per_node(cfg: Config, node_rank: int, gpus_on_node: int) -> int:
    """Learner ranks torchrun must start on `node_rank` (launch scripts ask `megatron-async placement`)."""
    return len(check_fit(cfg, gpus_on_node, None)[node_rank].learner)


def learner_nodes(cfg: Config) -> list[int]:
    """Placement node ranks that run learner ranks, in torchrun --node-rank order."""
    p = cfg.placement
    return [n for n in range(p.nnodes) if not (p.dedicated_replica_node and n == p.replica_node)]


# ----------------------------------------------------------------------------- runtime (under torchrun)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_runtime(cfg: Config) -> None:
    """On every learner rank, before building: torchrun's node count and this node's rank count."""
    p = cfg.placement
    nodes, want_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1")), len(learner_nodes(cfg))
    if nodes != want_nodes:
        dedicated = " of which one is the dedicated replica node (no torchrun there)" if p.dedicated_replica_node else ""
        raise ConfigError(f"key 'placement.nnodes' = {p.nnodes}{dedicated}: torchrun started {nodes} node(s) "
                          f"(--nnodes), expected {want_nodes}")
    gpus = _gpus()
    if not gpus:
        return  # CPU: device lists are ignored
    _check_gpu_count(cfg, gpus)
    node = learner_nodes(cfg)[int(os.environ.get("GROUP_RANK", "0"))]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    want = len(node_layout(cfg, node, gpus).learner)
    if local != want:
        raise ConfigError(
            f"key 'placement.learner_gpus' = {p.learner_gpus!r}: node {node} should start {want} learner ranks "
            f"(torchrun --nproc-per-node={want}; see `megatron-async placement`), but torchrun started {local}")


def _check_gpu_count(cfg: Config, gpus: int) -> None:
    if cfg.placement.gpus_per_node and cfg.placement.gpus_per_node != gpus:
        raise ConfigError(f"key 'placement.gpus_per_node' = {cfg.placement.gpus_per_node}: this node sees {gpus} CUDA devices")


def learner_device_index(cfg: Config) -> int | None:
    """CUDA index for this learner rank (LOCAL_RANK-th learner GPU of its node); None on CPU."""
    gpus = _gpus()
    if not gpus:
        return None
    node = learner_nodes(cfg)[int(os.environ.get("GROUP_RANK", "0"))]
    return node_layout(cfg, node, gpus).learner[int(os.environ.get("LOCAL_RANK", "0"))]


def replica_devices(cfg: Config) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each replica (for ReplicaPool(devices=...)) on the replica node; None on CPU."""
    gpus = _gpus()
    if not gpus:
        return None
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    name = lambda i: visible[i] if visible else str(i)  # noqa: E731 - index within the parent's view
    return [",".join(name(i) for i in ids) for ids in node_layout(cfg, cfg.placement.replica_node, gpus).replicas]


def cpu_plan(cfg: Config) -> CpuPlan:
    """This learner rank's CPU lists (parallel.learner_cpus, rollout.replica_cpus; "auto" resolved
    over the CPUs this process may use, for its node's local ranks and replicas)."""
    node = learner_nodes(cfg)[int(os.environ.get("GROUP_RANK", "0"))]
    replicas_here = (not cfg.rollout.replica_urls and not cfg.placement.dedicated_replica_node
                     and node == cfg.placement.replica_node)
    return plan_cpus(cfg.parallel.learner_cpus, cfg.rollout.replica_cpus, cpus=sorted(os.sched_getaffinity(0)),
                     cuda=_gpus() > 0, learner_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     replicas_here=replicas_here)


def check_reachable(replica_machine: str, urls: list[str]) -> None:
    """Every rank: loopback replica URLs are only reachable from the replicas' own machine."""
    hosts = [urlparse(u).hostname for u in urls]
    if socket.gethostname() != replica_machine and any(h in LOOPBACK_HOSTS for h in hosts):
        raise ConfigError(
            f"key 'rollout.host' = {hosts[0]!r}: replicas on {replica_machine} listen on loopback, unreachable from "
            f"{socket.gethostname()}: set rollout.host to the replica node's address (and rollout.token)")
