"""Narrow CPU stand-ins for the few CUDA-only calls megatron-core 0.16.1 makes.

megatron-core runs forward, backward, optimizer steps and dist_checkpointing on CPU with gloo
(tests/test_learner_parity.py and tests/dist/ run it there), except for a handful of calls that
assume a GPU. `apply()` patches exactly those, and only when `torch.cuda.is_available()` is False; on a GPU it does
nothing. It is idempotent, and every patch below names the CUDA call it replaces.

Three kinds of patch:
- functions replaced in the one megatron module that defines them (RNG tracker, grad clipping);
- two megatron methods wrapped so that, for the duration of that one call, a torch.Tensor method
  behaves as on a GPU (`_while_calling`): `Tensor.cuda` is the identity while the tied embeddings
  are set up, and `Tensor.type()` names CUDA types while the bf16 optimizer sorts its parameters;
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


def _while_calling(method, tensor_method: str, replacement):
    """`method`, with `torch.Tensor.<tensor_method>` replaced by `replacement(original)` for the
    duration of each call (restored afterwards, also when it raises)."""
    def wrapper(*args, **kwargs):
        saved = getattr(torch.Tensor, tensor_method)
        setattr(torch.Tensor, tensor_method, replacement(saved))
        try:
            return method(*args, **kwargs)
        finally:
            setattr(torch.Tensor, tensor_method, saved)

    return wrapper


def _identity_cuda(saved):
    # LanguageModule.setup_embeddings_and_output_layer calls `weight.data.cuda()` before the
    # all-reduce that copies tied embeddings to the last pipeline stage: stay on the CPU.
    return lambda self, *a, **k: self


def _cuda_type_names(saved):
    """`Tensor.type()` (no arguments: the type's name) for a CPU tensor names its CUDA type
    ("torch.BFloat16Tensor" -> "torch.cuda.BFloat16Tensor"); `.type(dtype)` (a cast) is unchanged.

    For `Float16OptimizerWithFloat16Params.__init__` only, whose one use of the name is to sort the
    parameters (megatron-core 0.16.1, optimizer.py:671-700): "torch.cuda.HalfTensor" or
    "torch.cuda.BFloat16Tensor" -> an fp32 main copy (`param.main_param`, what Adam steps),
    "torch.cuda.FloatTensor" -> trained as it is, anything else -> `TypeError: Wrapped parameters
    must be one of torch.cuda.FloatTensor, ...`. The sort is the GPU's: what a CPU parameter is
    denied is only the literal device in the name. Safe on CPU because nothing after it is
    CUDA-only: without Transformer Engine or apex the optimizer copies main <-> model params with
    megatron's `local_multi_tensor_scale` (plain `copy_`), and the gradient norm and clipping are
    `local_multi_tensor_l2_norm` and `_clip_grad_by_total_norm_fp32` here (their "cuda" tensors
    made on the CPU). The DistributedOptimizer has the same check (distrib_optimizer.py); it is
    never built on CPU (learner/perf.py), so it is not wrapped.
    Next megatron-core: Megatron-LM main (commit 0011998) still matches these names; where
    the check becomes device-agnostic (a dtype test) this patch goes, and where the constructor
    stops calling `param.type()` it is inert, and tests/test_optimizer_guard.py's bf16 case (it
    asserts fp32 main params) says whether bf16 still builds."""
    def type_(self, *args, **kwargs):
        name = saved(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return type_


def apply() -> bool:
    """Install the CPU shims if there is no CUDA. Returns True when they are (now) in place."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # torch.cuda.current_device(): RoPE inv_freq, TP/p2p buffers, attention all place tensors on it.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # a device, not an index
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

    LanguageModule.setup_embeddings_and_output_layer = _while_calling(
        LanguageModule.setup_embeddings_and_output_layer, "cuda", _identity_cuda)
    # bf16 parameters (model.dtype: bfloat16) get megatron's mixed-precision optimizer, as on a GPU
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _while_calling(
        optimizer.Float16OptimizerWithFloat16Params.__init__, "type", _cuda_type_names)

    cpu_torch = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        setattr(importlib.import_module(name), "torch", cpu_torch)

    _APPLIED = True
    return True
