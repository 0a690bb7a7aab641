"""The run plan: every `auto` of the config and every machine fact the run depends on, settled once.

    plan = build_plan(cfg)          # at launch (run/launch.py), and by eval, serve-replica, plan-sync
    log.info("%s", plan.describe()) # one line
    save_plan(plan, cfg.run_dir)    # plan.json beside config.yaml; `serve-replica` on another node reads it

It settles the model's dtype (the learner's and the replicas'), the learner's device (a CUDA device
here or not) and the fused kernels it has (`learner_backend`: the Transformer Engine spec, apex's
and megatron's legacy kernels; learner/perf.py turns them into settings per model), the weight
transport, the engine the replicas run for it, the delta-sync schedule, the sync buffer and the
CPU lists. The config (config.py) only checks values; this module alone turns `auto` into a
choice and probes the machine (CUDA devices and kernels, the CPU's flags, its CPUs) for it;
the learner, the replicas and the senders take the plan. Each learner rank builds one before it
pins itself (the CPU lists are its node's), and `Trainer.build` gives every rank rank 0's, so
that senders and replicas on different machines never choose differently.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron_async.cluster.cpu_affinity import AMX_BF16_FLAG, cpu_flags
from megatron_async.cluster.placement import cpu_plan
from megatron_async.config import Config, ModelConfig
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.perf import Backend
from megatron_async.transports import TRANSPORTS, carrier_for, sync_bucket_bytes, weight_engine

PLAN_FILE = "plan.json"  # in the run folder, beside config.yaml
AUTO_FULL_EVERY = 10  # rollout.sync_full_every: auto, where deltas pay


@dataclass(frozen=True)
class RunPlan:
    """What the run does where its config says `auto` or leaves it to the machine; each choice with why."""
    cuda: bool  # a CUDA device is visible: the learner runs on GPUs, the replicas this run starts too
    te_spec: bool  # the learner uses the Transformer Engine layer spec (TE importable, on CUDA)
    grad_accum_kernel: bool  # apex's fused_weight_gradient_mlp_cuda is importable (on CUDA)
    softmax_kernel: bool  # megatron's legacy scaled_(upper_triang_)masked_softmax_cuda are importable (on CUDA)
    model_dtype: str  # model.dtype: the learner trains in it, the replicas (vLLM) run in it, weights are sent in it
    model_dtype_why: str
    weight_transport: str  # rollout.weight_transport; "auto" left means host memory, shm or http per replica
    weight_transport_why: str
    weight_engine: str  # the vLLM weight-transfer engine the replicas run (transports.py)
    sync_full_every: int  # rollout.sync_full_every: 0 = every sync full, N = deltas between full syncs
    sync_full_every_why: str
    sync_bucket_bytes: int  # rollout.sync_bucket_mb in bytes
    learner_cpus: str  # parallel.learner_cpus as applied ("" = unpinned)
    replica_cpus: str  # rollout.replica_cpus as applied ("" = unpinned)
    cpus_why: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.model_dtype)

    @property
    def backend(self) -> Backend:
        """The learner's device and kernels, as learner/perf.py resolves its settings against them."""
        return Backend(cuda=self.cuda, te=self.te_spec, grad_accum_kernel=self.grad_accum_kernel,
                       softmax_kernel=self.softmax_kernel)

    def describe(self) -> str:
        """The plan on one line, for the log."""
        cpus = lambda c: f"CPUs {c}" if c else "unpinned"  # noqa: E731
        sync = f"deltas, a full sync every {self.sync_full_every}" if self.sync_full_every else "every sync full"
        kernels = [name for name, have in (("TE spec", self.te_spec), ("apex wgrad", self.grad_accum_kernel),
                                           ("legacy softmax", self.softmax_kernel)) if have]
        device = f"cuda ({', '.join(kernels) or 'no fused kernels'})" if self.cuda else "cpu"
        return (f"run plan: {device}; {self.model_dtype} ({self.model_dtype_why}); weights "
                f"over {self.weight_transport} ({self.weight_transport_why}) to engine {self.weight_engine}, "
                f"{sync} ({self.sync_full_every_why}), buffers of {self.sync_bucket_bytes >> 20} MiB; learner "
                f"{cpus(self.learner_cpus)}, replicas {cpus(self.replica_cpus)} ({self.cpus_why})")


def build_plan(cfg: Config, cuda: bool | None = None) -> RunPlan:
    """The plan of `cfg` on this machine. `cuda`: plan for a machine with (True) or without (False)
    a CUDA device instead of this one (`plan-sync` plans a GPU run from anywhere; that machine's
    fused kernels are unknown here, so its plan has none)."""
    r = cfg.rollout
    backend = learner_backend(cuda_here()) if cuda is None else Backend(cuda=cuda, te=False)
    cuda = backend.cuda
    dtype, dtype_why = model_dtype(cfg.model, cuda)
    transport, transport_why = weight_transport(cfg, cuda)
    # replicas this run starts, or a dedicated node's, listen at rollout.host
    urls = list(r.replica_urls) or [f"http://{r.host}"] * r.num_replicas
    full_every, full_why = resolve_full_every(r.sync_full_every, transport, urls, getattr(torch, dtype))
    cpus = cpu_plan(cfg)
    return RunPlan(cuda=cuda, te_spec=backend.te, grad_accum_kernel=backend.grad_accum_kernel,
                   softmax_kernel=backend.softmax_kernel, model_dtype=dtype, model_dtype_why=dtype_why,
                   weight_transport=transport, weight_transport_why=transport_why, weight_engine=weight_engine(transport),
                   sync_full_every=full_every, sync_full_every_why=full_why,
                   sync_bucket_bytes=sync_bucket_bytes(r.sync_bucket_mb, transport),
                   learner_cpus=cpus.learner, replica_cpus=cpus.replica, cpus_why=cpus.why)


def save_plan(plan: RunPlan, run_dir: str | os.PathLike) -> Path:
    """plan.json in the run folder (atomically)."""
    return atomic_write_text(Path(run_dir) / PLAN_FILE, json.dumps(dataclasses.asdict(plan), indent=1) + "\n")


def load_plan(run_dir: str | os.PathLike) -> RunPlan | None:
    """The plan a run saved in its folder, or None if it has not saved one (yet)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        return None
    return RunPlan(**json.loads(path.read_text()))


def cuda_here() -> bool:
    """A CUDA device is visible. Counted by NVML (torch.cuda.device_count), which neither
    initialises CUDA nor makes a later fork unsafe (torch.cuda.is_available would)."""
    return torch.cuda.device_count() > 0


def learner_backend(cuda: bool) -> Backend:
    """The learner's fused kernels on this machine, with CUDA (`cuda`) or without (none of them).
    megatron-core's TE extension is imported only with CUDA: a CPU process (a replica, eval) never
    loads megatron-core for the plan."""
    if not cuda:
        return Backend(cuda=False, te=False)
    from megatron.core.extensions.transformer_engine import HAVE_TE

    have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    return Backend(cuda=True, te=bool(HAVE_TE), grad_accum_kernel=have("fused_weight_gradient_mlp_cuda"),
                   softmax_kernel=have("scaled_masked_softmax_cuda")
                   and have("scaled_upper_triang_masked_softmax_cuda"))


def model_dtype(model: ModelConfig, cuda: bool | None = None) -> tuple[str, str]:
    """`model.dtype` -> (dtype, why), the learner's and the replicas' (vLLM) alike: the learner
    trains in it (bf16: bf16 parameters with fp32 main weights, grads and Adam state, megatron's
    mixed-precision optimizer; learner/optimizer.py) and sends its weights in it. auto picks
    bfloat16 on GPUs; float32 for the built-in tiny model (its 128-wide layers cost dispatch, not
    arithmetic, and fp32 keeps its replica's logprobs equal to the learner's); bfloat16 on a CPU
    with AMX (amx_bf16), whose tile units multiply bf16; float32 on any other CPU (vLLM emulates
    bf16 without avx512_bf16, and with it alone bf16 was not faster). The figures behind each
    choice: docs/real-models.md, "bf16 on CPU". `cuda`: as `build_plan`'s."""
    if model.dtype != "auto":
        return model.dtype, "model.dtype"
    if cuda_here() if cuda is None else cuda:
        return "bfloat16", "auto: a CUDA device"
    if model.hf_path == "tiny":
        return "float32", "auto: the built-in tiny model"
    if AMX_BF16_FLAG in cpu_flags():
        return "bfloat16", f"auto: this CPU has {AMX_BF16_FLAG}"
    return "float32", f"auto: a CPU without {AMX_BF16_FLAG}"


def weight_transport(cfg: Config, cuda: bool | None = None) -> tuple[str, str]:
    """`rollout.weight_transport` -> (the transport, why); "auto" stays "auto" where it means host
    memory (shm or http per replica, transports.carrier_for). auto picks nccl for GPU replicas: on
    a CUDA machine the replicas this run starts get GPUs (cluster/placement.py). NOTE: nccl's GPU
    communicator (vLLM's PyNccl) has not yet run on a GPU in this project; everything else of its
    path runs in CI over gloo. `cuda`: as `build_plan`'s."""
    r = cfg.rollout
    if r.weight_transport != "auto":
        return r.weight_transport, "rollout.weight_transport"
    if r.replica_urls:
        return "auto", "auto: servers started elsewhere (rollout.replica_urls) run an engine this run did not choose"
    if r.sync_full_every not in ("auto", 0) and not TRANSPORTS["nccl"].delta:
        return "auto", f"auto: delta sync (rollout.sync_full_every={r.sync_full_every}) is built for host memory"
    if cuda_here() if cuda is None else cuda:
        return "nccl", "auto: GPU replicas (a CUDA machine); nccl's GPU communicator has not yet run on a GPU"
    return "auto", "auto: CPU replicas"


def resolve_full_every(setting: int | str, transport: str, urls: Sequence[str], dtype: torch.dtype) -> tuple[int, str]:
    """`rollout.sync_full_every` -> (the update's `full_every`, why). auto: deltas (weights/delta.py)
    only where the bytes are what a sync costs, a replica reached over http, and for a 2-byte
    replica dtype (an fp32 Adam step changes most elements: its deltas go whole). Over shm and
    gloo the replica's loading, not the bytes, sets the time, so a delta's encoding is a loss, and
    nccl has no delta path (measured and explained in docs/replicas-and-weight-sync.md)."""
    if setting != "auto":
        return int(setting), "rollout.sync_full_every"
    if TRANSPORTS[transport].broadcast:
        return 0, f"auto: over {transport} a sync's time is the replica's loading, not the bytes"
    http = [u for u in urls if carrier_for(transport, u) == "http"]
    if http and dtype.itemsize == 2:
        return AUTO_FULL_EVERY, f"auto: {dtype} replicas reached over http ({len(http)} of {len(urls)})"
    return 0, f"auto: {'no replica is reached over http' if not http else f'{dtype} changes most elements per step'}"
