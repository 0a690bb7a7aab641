"""The run's replica pool from its config: how every replica's server starts, and where it runs."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from megatron_async.cluster.cpu_affinity import replica_pin_env
from megatron_async.cluster.placement import replica_devices
from megatron_async.config import Config
from megatron_async.models.base_model import prepare_base_model
from megatron_async.rollout.launcher import replica_environment
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.replica import ReplicaSpec, server_command, server_env
from megatron_async.run_plan import RunPlan, build_plan, load_plan


def replica_spec(cfg: Config, plan: RunPlan, model: Path) -> ReplicaSpec:
    """How every replica of this run starts its vLLM server (dtype and engine: the run plan's)."""
    r = cfg.rollout
    return ReplicaSpec(model=str(model), dtype=plan.model_dtype, tensor_parallel_size=r.replica_tp,
                       max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens,
                       kv_cache_bytes=int(r.kv_cache_gib * (1 << 30)), seed=cfg.run.seed,
                       prefix_caching=r.weight_update == "between_batches",
                       weight_backend=plan.weight_engine)


def replica_urls(cfg: Config) -> list[str]:
    """Servers started elsewhere: rollout.replica_urls, or a dedicated replica node's
    (rollout.host:rollout.base_port + i); [] = the pool starts them here."""
    r = cfg.rollout
    if r.replica_urls:
        return list(r.replica_urls)
    if cfg.placement.dedicated_replica_node:
        return [f"http://{r.host}:{r.base_port + i}" for i in range(r.num_replicas)]
    return []


def start_pool(cfg: Config, plan: RunPlan, model: Path) -> ReplicaPool:
    """The run's replicas serving `model`: servers started here (one process group each), or the
    URLs of servers started elsewhere."""
    r = cfg.rollout
    common: dict[str, Any] = dict(key=r.token or None, start_timeout_s=r.startup_timeout_s,
                                  request_timeout_s=r.generate_timeout_s, max_failures=r.max_replica_failures)
    if urls := replica_urls(cfg):
        return ReplicaPool(replica_spec(cfg, plan, Path(model)), urls=urls, **common).start()
    return ReplicaPool(replica_spec(cfg, plan, Path(model).resolve()), r.num_replicas, host=r.host, base_port=r.base_port,
                       log_dir=cfg.run_dir / "replicas", devices=replica_devices(cfg),  # None on CPU
                       env=replica_pin_env(plan.replica_cpus), **common).start()


def serve_replica(cfg: Config, index: int) -> int:
    """`megatron-async serve-replica`: become replica `index`'s vLLM server (exec, so the process a
    launcher such as srun watches is vLLM's own) at rollout.host:rollout.base_port + index,
    serving the run's base model; the learner pushes its own weights before training."""
    r = cfg.rollout
    problems = [why for bad, why in (
        (not r.token, "rollout.token is empty (or set $MEGATRON_ASYNC_ROLLOUT_TOKEN): every route needs the key"),
        (not r.base_port, "rollout.base_port is 0: replica i listens on rollout.base_port + i"),
        (not 0 <= index < r.num_replicas, f"--index {index} is not in [0, rollout.num_replicas={r.num_replicas})"),
    ) if bad]
    if problems:
        print("megatron-async serve-replica: " + "; ".join(problems), file=sys.stderr)
        return 2
    plan = load_plan(cfg.run_dir)  # the learner's, where the run folder is shared and it has started
    if plan is None:
        plan = build_plan(cfg)
        print(f"megatron-async serve-replica: no {cfg.run_dir}/plan.json (yet); planned here: {plan.describe()}",
              file=sys.stderr)
    spec = replica_spec(cfg, plan, Path(prepare_base_model(cfg)).resolve())
    gpu = torch.cuda.is_available()
    env = {**replica_environment(os.environ), **server_env(spec, r.token, gpu)}  # the learner's NCCL_*, not its own (launcher.py)
    if devices := replica_devices(cfg):
        env["CUDA_VISIBLE_DEVICES"] = devices[index]
    cmd = server_command(spec, r.host, r.base_port + index, gpu)
    os.execvpe(cmd[0], cmd, env)
