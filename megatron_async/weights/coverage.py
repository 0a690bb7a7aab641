"""Which model parameters an open weight update has loaded: the check that a sync replaced every
weight (our engines' `{"verify": true}` call), shared by weights/cpu_engine.py and
weights/broadcast_engine.py."""
from __future__ import annotations

from typing import Iterable

import torch


class UpdateCoverage:
    def __init__(self):
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
