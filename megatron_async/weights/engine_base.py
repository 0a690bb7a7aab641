"""What our three vLLM weight-transfer engines share: `mas_cpu` (weights/cpu_engine.py) and
`mas_nccl` / `mas_gloo` (weights/broadcast_engine.py) supply only how a bucket arrives (`receive`);
this base runs the update around it, the same for every transport:

- start: record the model's parameters (`UpdateCoverage`), then vLLM's layerwise reload begins;
- each bucket (`update_weights`): the `{"verify": true}` call answers whether the update covered
  every parameter (a sync replaces every weight or is reported failed); any other bucket is the
  engine's `receive`, which hands its tensors to `load`: with `keep` (delta sync,
  weights/delta.py) through the engine's `DeltaDecoder`, whose kept copy is the next delta's base;
  every name `load_weights` returns is recorded;
- a bucket that fails (a bad checksum, a dead group, a delta without a base) ends the update:
  vLLM's worker closes its session, and the layers still waiting for weights are restored as they
  were (`vllm_plugin.abort_reload`), so that a later full update starts clean;
- finish: vLLM's layerwise reload is finalized, then a tied `lm_head` is re-packed from the new
  embedding (`vllm_plugin.refresh_tied_head`).

`verify` is an update call, not part of finish, because a failing `update_weights` closes vLLM's
update session while a failing `finish_weight_update` leaves it open, and no later update could
start. Every touch of vLLM's internals is weights/vllm_plugin.py's (checked against its version).
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from megatron_async.weights.delta import DeltaDecoder
from megatron_async.weights import vllm_plugin

# NOTE: finalize_layerwise_reload warns "Failed to load weights" for a layer no bucket touched;
# the verify call checks coverage itself and fails loudly instead.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


class UpdateCoverage:
    """Which model parameters an open weight update has loaded."""

    def __init__(self) -> None:
        self._expected: set[str] = set()  # the model's parameter names (vLLM's), taken at start
        self._loaded: set[str] | None = None  # those loaded so far; None outside an update

    def start(self, model: torch.nn.Module) -> None:
        """Call before vLLM's `initialize_layerwise_reload`. NOTE: that reload puts each layer's
        tensors on the meta device one layer at a time, so a tied lm_head gets a meta weight of its
        own and `named_parameters` lists `lm_head.weight`, which no update sends (measured: every
        sync of a tied model failed the check). Before it, the tied head is the embedding."""
        self._expected = {name for name, _ in model.named_parameters()}
        self._loaded = set()

    @property
    def is_open(self) -> bool:
        """An update is open: between `start` and `stop`."""
        return self._loaded is not None

    def record(self, loaded: Iterable[str] | None) -> None:
        """What one `model.load_weights` call returned (the parameters it loaded)."""
        if self._loaded is None:
            raise RuntimeError("update_weights before start_weight_update")
        self._loaded |= set(loaded or ())

    def check(self) -> None:
        """Raise unless every parameter was loaded in this update."""
        if self._loaded is None:
            raise RuntimeError("verify before start_weight_update")
        if missing := sorted(self._expected - self._loaded):
            raise RuntimeError(f"weight update incomplete: {len(missing)} of {len(self._expected)} parameters not sent, "
                               f"e.g. {missing[:5]}")

    def stop(self) -> None:
        self._loaded = None


class MasEngine:
    """The shared part of our engines; listed before vLLM's engine class in theirs (it overrides
    vLLM's start / update / finish). Set by vLLM's constructor: `model`, `model_config`, `device`."""

    model: torch.nn.Module
    model_config: Any
    device: torch.device

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_plugin.require_vllm()  # before anything of it is touched: a clear error on another vLLM
        super().__init__(*args, **kwargs)
        self.coverage = UpdateCoverage()  # which parameters the open update loaded
        self.deltas = DeltaDecoder()  # the weights as last loaded, where the sender sends deltas

    def start_weight_update(self) -> None:
        self.coverage.start(self.model)  # before the reload (UpdateCoverage.start says why)
        vllm_plugin.start_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # NOTE: instead of the base class's unconditional `torch.accelerator.synchronize()`, which
        # has nothing to wait for on CPU and no accelerator to ask there
        try:
            self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]
            if self.device.type != "cpu":
                torch.accelerator.synchronize()
        except BaseException:
            self.coverage.stop()
            vllm_plugin.abort_reload(self.model)
            raise

    def receive_weights(self, update_info: Any) -> None:
        if not self.coverage.is_open:
            raise RuntimeError("update_weights before start_weight_update")
        if update_info.verify:
            self.coverage.check()
            return
        self.receive(update_info)

    def receive(self, update_info: Any) -> None:
        """One bucket: its tensors, however they come, into `load`."""
        raise NotImplementedError

    def load(self, named: Iterable[tuple[str, torch.Tensor]], keep: bool, owned: bool = False) -> None:
        """`model.load_weights` of (wire name, tensor) pairs; with `keep`, each decoded and kept
        first (a copy unless `owned`: a carrier's memory is the sender's to rewrite)."""
        if keep:
            named = [self.deltas.decode(name, tensor, owned) for name, tensor in named]
        self.coverage.record(self.model.load_weights(named))  # type: ignore[operator]

    def finish_weight_update(self) -> None:
        self.coverage.stop()
        vllm_plugin.finish_reload(self.model, self.model_config)
        vllm_plugin.refresh_tied_head(self.model)  # a CPU replica's packed head copy; nothing to do on GPU

    def shutdown(self) -> None:
        self.coverage.stop()
