"""`megatron-async plan-sync CONFIG [overrides]`: what one weight sync of a GPU layout costs, computed
from the model's config.json (no weights) before any GPU is held.

    megatron-async plan-sync configs/gpu_rho1b_gsm8k.yaml placement.gpus_per_node=8
    megatron-async plan-sync CONFIG [overrides] --json --ib-gbps 40 --call-overhead-ms 10

Per learner pipeline stage: the bytes its sender pushes to each replica, the buffers they are
packed in, the /update_weights calls each replica gets, the communicator groups and the links the
bytes cross, and seconds computed from link bandwidths and a per-call overhead (the flags; their
defaults and how the overhead was measured: docs/scaling.md). `--json`: the same as one object.

It runs the push's own code on shapes only: the learner's model built from model.hf_path's
config.json on the meta device at TP = PP = 1 (learner/model.py, megatron's local spec: no weights
read, no memory), megatron's own layer split into parallel.pp stages (`get_num_layers_to_build`,
`get_transformer_layer_offset`), `iter_hf_weights` (the HF names and shapes a stage's sender
yields, in its order), the cast to the replicas' dtype (the run plan's for a GPU machine:
`run_plan.build_plan(cfg, cuda=True)`), and the buffers at
`transports.sync_bucket_bytes(rollout.sync_bucket_mb, transport)` (auto: 1024 MiB over nccl / gloo,
64 over shm / http). The nodes are cluster/placement.py's: each stage's sender
(`weight_senders`) and the replica node, checked as a run checks them.

The push it models is the one built (weights/broadcast.py, weights/update.py):
- nccl / gloo: a stage reaches each replica through ONE /update_weights carrying its whole
  manifest, its tensors packed as vLLM's producer packs them (`packed_buffers`: tensors in stream
  order until the running total exceeds the cap, the one that crosses it included), double-
  buffered (packing and the TP gathers overlap the broadcast and are not counted). Each stage
  has one group per replica node (the sender + every replica's replica_tp workers, vLLM's
  `rank_offset` layout; the replicas here all are on placement.replica_node), so a stage's bytes
  cross into the node once: InfiniBand from a sender on another node, NVLink inside one. A stage
  takes bytes / link per group + its calls x the per-call overhead; the stages add up (a
  replica's engine serves one call at a time, and where a group spans several replicas the
  stages stream in turn, weights/build.py `stage_turns`). nccl only: gloo moves the bytes over
  TCP through host memory.
- shm / http (host memory): one /update_weights per buffer (`group_by_cap`), no group; their
  time is copies through host memory (docs/scaling.md), not modelled here.
- every push adds the pool's phase calls to each replica (`PHASE_CALLS`), at the same overhead.
Not counted: group formation (the first push, and after a failure) and the replica's load into
its parameters (device memory on GPU).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state  # megatron-core at the top: only plan-sync imports this module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_async.cluster.placement import check_fit, weight_senders
from megatron_async.config import Config, ConfigError, load_config
from megatron_async.learner.mapping import EMBED, iter_hf_weights
from megatron_async.learner.model import build_model, read_arch, read_hf_config, transformer_config
from megatron_async.learner.perf import Backend, resolve
from megatron_async.run_plan import build_plan
from megatron_async.transports import TRANSPORTS
from megatron_async.weights.host_memory import carrier_for
from megatron_async.weights.update import group_by_cap

# The flags' defaults (docs/scaling.md, "Weight-sync budgets, computed", says where each comes from).
NVLINK_GB_PER_S = 450.0
INFINIBAND_GB_PER_S = 50.0
CALL_OVERHEAD_MS = 3.0
# per replica and push, besides /update_weights: ReplicaPool.begin_update and finish_update (rollout/pool.py)
PHASE_CALLS = ("pause", "start_weight_update", "verify_weight_update", "finish_weight_update", "resume")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Links:
    """What a second of a sync is computed from: GB/s (10^9 bytes) per link, seconds per call."""

    nvlink_gb_per_s: float = NVLINK_GB_PER_S
    infiniband_gb_per_s: float = INFINIBAND_GB_PER_S
    call_overhead_s: float = CALL_OVERHEAD_MS / 1e3

    def seconds(self, nbytes: int, link: str) -> float:
        gb_per_s = self.nvlink_gb_per_s if link == "nvlink" else self.infiniband_gb_per_s
        return nbytes / (gb_per_s * 1e9)


@dataclass(frozen=True)
class Group:
    """The replicas that a stage's sender reaches through one communicator group: all of a node's
    (weights/broadcast.py). Its bytes cross its link once."""

    node: int
    replicas: list[int]
    ranks: int  # the sender + every replica's workers
    link: str  # what the stage's bytes cross into the node: nvlink (the sender's node) or infiniband


@dataclass
class StagePlan:
    stage: int
    layers: range  # the decoder layers it holds (0-based)
    sender_rank: int
    sender_node: int
    tensors: int
    bytes: int  # to each replica
    buffers: int
    calls_per_replica: int  # /update_weights
    groups: list[Group]  # empty for host memory
    carrier: str  # how the bytes travel: nccl, gloo, shm, http
    seconds: float | None  # None: not modelled (gloo, host memory)


@dataclass
class SyncPlan:
    """One weight sync of a run's layout (module docstring)."""

    model: str  # model.hf_path
    parameters: int
    dtype: str  # the replicas', which the tensors are sent in
    transport: str
    bucket_mb: int  # rollout.sync_bucket_mb resolved for the transport (transports.sync_bucket_bytes)
    learner: dict[str, int]  # tp, pp, dp, nodes (running learner ranks), job_nodes
    replicas: dict[str, int]  # count, tp, node
    links: Links
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stages)

    @property
    def calls_per_replica(self) -> int:
        """/update_weights calls and the pool's phase calls that each replica gets per push."""
        return sum(s.calls_per_replica for s in self.stages) + len(PHASE_CALLS)

    @property
    def seconds(self) -> float | None:
        if any(s.seconds is None for s in self.stages):
            return None
        return sum(s.seconds or 0.0 for s in self.stages) + len(PHASE_CALLS) * self.links.call_overhead_s

    def to_json(self) -> dict:
        stages = [asdict(s) | {"layers": [s.layers.start, s.layers.stop]} for s in self.stages]
        return {"model": self.model, "parameters": self.parameters, "dtype": self.dtype, "transport": self.transport,
                "bucket_mb": self.bucket_mb, "design": self.design, "learner": self.learner, "replicas": self.replicas,
                "links": asdict(self.links), "phase_calls_per_replica": list(PHASE_CALLS), "stages": stages,
                "total": {"bytes": self.bytes, "calls_per_replica": self.calls_per_replica, "seconds": self.seconds}}

    design = "built: one group per (stage, replica node)"

    def render(self) -> str:
        ln, r, links = self.learner, self.replicas, self.links
        lines = [
            f"design: {self.design}",
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters, sent in {self.dtype}: "
            f"{self.bytes / 1e9:.2f} GB to each replica",
            f"learner TP={ln['tp']} x PP={ln['pp']} x DP={ln['dp']} on {ln['nodes']} of {ln['job_nodes']} node(s); "
            f"{r['count']} replica(s) "
            f"of TP={r['tp']} on node {r['node']}; {self.transport}, buffers of {self.bucket_mb} MiB",
            f"computed with NVLink {links.nvlink_gb_per_s:g} GB/s, InfiniBand {links.infiniband_gb_per_s:g} GB/s, "
            f"{links.call_overhead_s * 1e3:g} ms per call",
            "",
            f"{'stage':<6}{'layers':<8}{'sender':<17}{'bytes':>11}{'buffers':>9}{'calls':>7}  {'groups (ranks)':<16}"
            f"{'links crossed':<30}{'seconds':>8}",
        ]
        for s in self.stages:
            groups = ", ".join(f"{n} x node {node} ({ranks})" for (node, ranks, _), n in _alike(s.groups)) or "-"
            crossed = ", ".join(_crossed(s.sender_node, node, link, n) for (node, _, link), n in _alike(s.groups)) \
                or s.carrier
            lines.append(f"{s.stage:<6}{f'{s.layers.start}-{s.layers.stop - 1}':<8}"
                         f"{f'rank {s.sender_rank}, node {s.sender_node}':<17}{_gb(s.bytes):>11}{s.buffers:>9}"
                         f"{s.calls_per_replica:>7}  {groups:<22}{crossed:<30}{_seconds(s.seconds):>8}")
        phases = len(PHASE_CALLS) * links.call_overhead_s
        names = ", ".join(call.removesuffix("_weight_update") for call in PHASE_CALLS)
        lines.append(f"{'pool phases':<51}{len(PHASE_CALLS):>7}  {names:<52}{phases:>8.3f}")
        lines.append(f"{'total':<31}{_gb(self.bytes):>11}{sum(s.buffers for s in self.stages):>9}"
                     f"{self.calls_per_replica:>7}  {'':<52}{_seconds(self.seconds):>8}")
        if self.seconds is None:
            lines.append(f"seconds: not modelled over {self.stages[0].carrier} (nccl only; megatron-async plan-sync --help)")
        return "\n".join(lines)


def _alike(groups: list[Group]) -> list[tuple[tuple[int, int, str], int]]:
    """(node, ranks, link) of a stage's groups, with how many groups share them, in order."""
    return list(Counter((g.node, g.ranks, g.link) for g in groups).items())


def _crossed(sender_node: int, node: int, link: str, times: int) -> str:
    where = f"NVLink inside node {node}" if link == "nvlink" else f"InfiniBand node {sender_node}->{node}"
    return f"{where}, {'once' if times == 1 else f'{times}x'}"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plan_sync(cfg: Config, links: Links) -> SyncPlan:
    """The plan of one weight sync of `cfg`'s layout on GPUs, as built. Raises ConfigError naming the key."""
    p, par, r = cfg.placement, cfg.parallel, cfg.rollout
    if not p.gpus_per_node:
        raise ConfigError("key 'placement.gpus_per_node' = 0: set it (the GPUs of each node of the layout to plan)")
    layouts = check_fit(cfg, p.gpus_per_node, par.world_size or None)
    senders = weight_senders(cfg, layouts)
    dp = len([rank for lay in layouts for rank in lay.learner]) // (par.tp * par.pp)
    run_plan = build_plan(cfg, cuda=True)
    transport, dtype = run_plan.weight_transport, run_plan.model_dtype
    replicas = list(range(len(r.replica_urls) or r.num_replicas))
    bucket_bytes = run_plan.sync_bucket_bytes
    hf_config = _hf_config(cfg)
    stages = stage_tensors(hf_config, par.tp, par.pp)
    plan = SyncPlan(model=cfg.model.hf_path, parameters=sum(t.numel() for _, ts in stages for _, t in ts), dtype=dtype,
                    transport=transport, bucket_mb=bucket_bytes >> 20,
                    learner={"tp": par.tp, "pp": par.pp, "dp": dp, "nodes": sum(1 for lay in layouts if lay.learner),
                             "job_nodes": p.nnodes},
                    replicas={"count": len(replicas), "tp": r.replica_tp, "node": p.replica_node}, links=links)
    for stage, ((layers, tensors), (sender_rank, sender_node)) in enumerate(zip(stages, senders)):
        sent = [(name, t.to(getattr(torch, dtype))) for name, t in tensors]  # as weights/update.py casts them
        nbytes = sum(t.numel() * t.element_size() for _, t in sent)
        if TRANSPORTS[transport].broadcast:  # the replicas all are on p.replica_node
            link = "nvlink" if sender_node == p.replica_node else "infiniband"
            groups = [Group(p.replica_node, replicas, 1 + len(replicas) * r.replica_tp, link)]
            calls = 1  # the stage's whole manifest
            seconds = (sum(links.seconds(nbytes, g.link) for g in groups) + calls * links.call_overhead_s
                       if transport == "nccl" else None)
            plan.stages.append(StagePlan(stage, layers, sender_rank, sender_node, len(sent), nbytes,
                                         packed_buffers((t.numel() * t.element_size() for _, t in sent), bucket_bytes), calls, groups, transport, seconds))
        else:
            carrier = carrier_for(transport, f"http://{r.host}")
            buffers = sum(1 for _ in group_by_cap(sent, bucket_bytes))
            plan.stages.append(StagePlan(stage, layers, sender_rank, sender_node, len(sent), nbytes, buffers, buffers,
                                         [], carrier, None))
    return plan


def packed_buffers(sizes: Iterable[int], cap_bytes: int) -> int:
    """The buffers vLLM's packed producer fills with tensors of these byte sizes, in order, at
    `cap_bytes`: its `pack_tensors` rule (vllm/distributed/weight_transfer/packed_tensor.py) adds
    tensors until the running total exceeds the cap, the one that crosses it included. Written out
    because importing vLLM starts a process (`platform`), which a planner has no need of;
    tests/test_plan_sync.py checks it against vLLM's own function."""
    buffers = total = 0
    for size in sizes:
        total += size
        if total > cap_bytes:
            buffers, total = buffers + 1, 0
    return buffers + (total > 0)


def _hf_config(cfg: Config) -> dict:
    """model.hf_path's config.json, as a run reads it (the tiny model has none before its run built
    it), of a model that splits at parallel.tp x parallel.pp."""
    if cfg.model.hf_path == "tiny":
        raise ConfigError("key 'model.hf_path' = 'tiny': plan-sync reads an HF config.json; the tiny model is built "
                          "by its run (<run dir>/base_model): pass that folder")
    try:
        hf_config = read_hf_config(cfg.model.hf_path)
        arch = read_arch(hf_config)  # a model the learner builds
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"key 'model.hf_path' = {cfg.model.hf_path!r}: {e}") from None
    if problems := arch.split_problems(cfg.parallel.tp, cfg.parallel.pp):  # as run/preflight.py words it
        axis, why = problems[0]
        raise ConfigError(f"key 'parallel.{axis}' = {getattr(cfg.parallel, axis)}: {why} in {cfg.model.hf_path}/config.json")
    return hf_config


def stage_tensors(hf_config: dict, tp: int, pp: int) -> list[tuple[range, list[tuple[str, torch.Tensor]]]]:
    """Each pipeline stage's decoder layers and the HF tensors its sender yields, in order, as meta
    tensors (shapes and dtypes only), for a learner at TP x PP (module docstring)."""
    arch = read_arch(hf_config)
    split = transformer_config(arch, tp, pp, perf=resolve(None, Backend(cuda=False, te=False), tp=tp, dp=1,
                                                          tied_embeddings=arch.tie_word_embeddings))
    cpu = resolve(None, Backend(cuda=False, te=False), tp=1, dp=1, tied_embeddings=arch.tie_word_embeddings)
    with _one_rank_learner(), torch.device("meta"):
        whole = list(iter_hf_weights(build_model(hf_config, perf=cpu)))
    stages = []
    for stage in range(pp):
        first = get_transformer_layer_offset(split, pp_rank=stage)
        layers = range(first, first + get_num_layers_to_build(split, pp_rank=stage))
        stages.append((layers, [(name, t) for name, t in whole if _on_stage(name, layers, stage == 0, stage == pp - 1)]))
    return stages


def _on_stage(name: str, layers: range, first: bool, last: bool) -> bool:
    """Whether a stage holding `layers` yields HF tensor `name`: its layers' tensors; the embedding
    on the first stage (megatron's pre_process), the final norm and the LM head on the last
    (post_process; a tied head is never yielded, mapping.iter_hf_weights)."""
    if match := _LAYER.match(name):
        return int(match.group(1)) in layers
    return first if name == EMBED else last


@contextmanager
def _one_rank_learner() -> Iterator[None]:
    """megatron's parallel state of one rank (TP = PP = 1) in this process, on a store without a
    port: what `build_model` and `iter_hf_weights` need. What was set up before is kept."""
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_state = not parallel_state.model_parallel_is_initialized()
    if own_state:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if own_state:
            parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-async plan-sync", epilog="example: megatron-async plan-sync configs/gpu_rho1b_gsm8k.yaml "
        "placement.gpus_per_node=8 model.hf_path=DIR --json",
        description="One weight sync of a GPU layout, computed from the model's config.json (no weights read): per "
                    "pipeline stage the bytes, buffers, /update_weights calls per replica, groups, links crossed and "
                    "seconds from the link bandwidths and per-call overhead below (docs/scaling.md).")
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. placement.gpus_per_node=8")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_GB_PER_S,
                   help="GB/s (10^9 bytes/s) of a broadcast inside a node (default %(default)g: H100 NVLink, one "
                        "direction; docs/scaling.md)")
    p.add_argument("--ib-gbps", type=float, default=INFINIBAND_GB_PER_S,
                   help="GB/s (10^9 bytes/s) of a broadcast into another node (default %(default)g: one 400 Gb/s "
                        "InfiniBand NIC; docs/scaling.md)")
    p.add_argument("--call-overhead-ms", type=float, default=CALL_OVERHEAD_MS,
                   help="milliseconds per call to a replica (default %(default)g: measured with bench rollout, "
                        "docs/scaling.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    """`megatron-async plan-sync`: print the plan (text, or --json); a bad config or flag is one line, 2."""
    args = build_parser().parse_intermixed_args(argv)  # overrides may stand after the flags
    try:
        for flag, value in (("--nvlink-gbps", args.nvlink_gbps), ("--ib-gbps", args.ib_gbps)):
            if value <= 0:
                raise ConfigError(f"{flag} = {value:g}: must be > 0")
        if args.call_overhead_ms < 0:
            raise ConfigError(f"--call-overhead-ms = {args.call_overhead_ms:g}: must be >= 0")
        plan = plan_sync(load_config(args.config, args.overrides),
                         Links(args.nvlink_gbps, args.ib_gbps, args.call_overhead_ms / 1e3))
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.render())
    return 0
