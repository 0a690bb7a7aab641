"""Narrow CPU stand-ins for the few CUDA-only calls megatron-core 0.16.1 makes.

megatron-core runs forward, backward, optimizer steps and dist_checkpointing on CPU with gloo
(see ../shared/notes/cpu-stack.md), except for a handful of calls that assume a GPU. `apply()`
patches exactly those, and only when `torch.cuda.is_available()` is False; on a GPU it does
nothing. It is idempotent, and every patch below names the CUDA call it replaces.

Two kinds of patch:
- functions replaced in the one megatron module that defines them (RNG tracker, grad clipping);
- in a short list of megatron modules that create tensors with a literal `device="cuda"`, the
  module's global `torch` is swapped for `_CpuTorch`, a view of torch whose tensor factories map
  "cuda" to "cpu". Nothing outside those modules sees it.
`torch.cuda.current_device` and `torch.cuda.synchronize` are the only process-wide patches:
megatron calls them from dozens of modules, and without CUDA both would raise anyway.
"""
from __future__ import annotations

import importlib
import types

import torch

_APPLIED = False

# Modules whose code writes `torch.<factory>(..., device="cuda")` on the paths we use.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # FP32Optimizer._scale = torch.tensor([1.0], device='cuda')
    "megatron.core.optimizer.clip_grads",  # total_norm_cuda = torch.tensor(..., device='cuda')
    "megatron.core.utils",  # local_multi_tensor_l2_norm: torch.tensor(..., device="cuda")
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # torch.tensor(..., device='cuda')
    "megatron.core.dist_checkpointing.exchange_utils",  # torch.empty_like(t, device="cuda")
)
_FACTORIES = ("zeros", "ones", "empty", "empty_like", "zeros_like", "tensor", "full")


def _on_cpu(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cuda":
        kwargs["device"] = "cpu"
    return kwargs


class _CpuTorch(types.ModuleType):
    """`torch`, except that tensor factories called with device="cuda" allocate on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return lambda *args, **kwargs: attr(*args, **_on_cpu(kwargs))
        return attr


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    # replaces tensor_parallel.random._get_cuda_rng_state (torch.cuda.default_generators[i].get_state())
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    # replaces tensor_parallel.random._set_cuda_rng_state (torch.cuda default generator .set_state)
    torch.set_rng_state(new_state)


def _tracker_add(self, name, seed):
    # replaces CudaRNGStatesTracker.add, which seeds via torch.cuda.manual_seed/get_rng_state;
    # the tracked state is a CPU generator state, swapped into the CPU RNG by `fork()`.
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    # replaces clip_grads.clip_grad_by_total_norm_fp32, which asserts
    # `grad.type() == 'torch.cuda.FloatTensor'` and scales with apex/TE multi_tensor_scale.
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    for p in parameters:
        grad = getattr(p, attr, None)
        if grad is not None:
            grad.detach().mul_(clip_coeff)


def _keep_on_cpu(method):
    # LanguageModule.setup_embeddings_and_output_layer calls `weight.data.cuda()` before the
    # all-reduce that copies tied embeddings to the last pipeline stage; make `Tensor.cuda` the
    # identity for the duration of that one call.
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = saved

    return wrapper


def apply() -> bool:
    """Install the CPU shims if there is no CUDA. Returns True when they are (now) in place."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # torch.cuda.current_device(): RoPE inv_freq, TP/p2p buffers, attention all place tensors on it.
    torch.cuda.current_device = lambda: "cpu"
    # torch.cuda.synchronize(): dist_checkpointing save and p2p call it; nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    mrandom.CudaRNGStatesTracker.add = _tracker_add

    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _keep_on_cpu(LanguageModule.setup_embeddings_and_output_layer)

    cpu_torch = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_torch

    _APPLIED = True
    return True
