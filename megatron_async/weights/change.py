"""How much of the model one sync changes.

`weight_sync/changed_fraction`: the fraction of weight elements that differ, in the replicas' dtype, from what the previous sync
sent: what a delta sync (only the changed elements) could save. It depends on the dtype: an fp32
Adam step moves nearly every element, while in bf16 an update below half a unit in the last place
leaves the element as it was (peers report 1-5% of bf16 weights changing per step at RL learning
rates; `../shared/notes/peers-late-2026.md` 1c).

Measured on a fixed sample, so that it costs little and keeps little: every element of a tensor
of at most `WHOLE_TENSOR` elements, every `STRIDE`-th element (a prime, so that the sample does
not line up with rows) of a larger one. The sample kept between syncs is about 1/STRIDE of the
model in the replicas' dtype (SmolLM2-135M: 9 MB; an 8B model: 0.26 GB, on the device the sender's
tensors live on).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

WHOLE_TENSOR = 4096
STRIDE = 61


class ChangeMeter:
    """On a stage's sender rank: `observe` the tensors of each push; `changed` / `compared` count the last."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._previous: dict[str, torch.Tensor] = {}  # name -> the sample of the last push
        # elements, in the last push, of tensors the push before it sent too; the changed count is
        # summed where the tensors are (a GPU's), and read to the host once per push, by `changed`
        self._changed: torch.Tensor | int = 0
        self.compared = 0

    def observe(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `named_tensors` unchanged, counting the sampled elements that differ from the last push."""
        self._changed = self.compared = 0
        for name, tensor in named_tensors:
            flat = tensor.detach().reshape(-1)
            sample = (flat if flat.numel() <= WHOLE_TENSOR else flat[::STRIDE]).to(self.dtype, copy=True)
            if (previous := self._previous.get(name)) is not None and previous.shape == sample.shape:
                self._changed = self._changed + (sample != previous).sum()
                self.compared += sample.numel()
            self._previous[name] = sample
            yield name, tensor

    @property
    def changed(self) -> int:
        return int(self._changed)
