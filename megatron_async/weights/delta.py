"""What one sync changed, and delta weight sync: only the changed elements, as overwrites.

    encoder = DeltaEncoder(keep_whole=bool(full_every))       # a stage sender rank's, for the whole run
    schedule = DeltaSchedule(full_every)                       # with delta sync
    delta = schedule.begin(urls)                               # each push: may it be a delta?
    stream = encoder.encode(named_tensors, delta)              # (name, whole or delta) pairs
    schedule.end(reached, delta)                               # the replicas that took all of it
    encoder.changed, encoder.compared                          # weight_sync/changed_fraction
    decoder = DeltaDecoder()                                   # each replica engine's
    full = decoder.decode(name, tensor)                        # the tensor to load, after the overwrite

weights/update.py builds a push's stream once, with this encoder: the tensors cast to the
replicas' dtype, compared with what the last push sent by one exact, bit-based comparison, which
gives both the metric and the delta.

What one sync changes (`weight_sync/changed_fraction`): in bf16 a small Adam step leaves most
elements as they were (1-2% change per step in our SmolLM2 runs; slime, verl, SkyRL
and TRL report 1-5% for their delta sync); in fp32 nearly every element moves (82-92%). Without
delta sync the encoder keeps only a fixed sample to count on, so that the metric costs little and
keeps little: every element of a tensor of at most `WHOLE_TENSOR` elements, every `STRIDE`-th
element (a prime, so that the sample does not line up with rows) of a larger one, about 1/STRIDE
of the model (SmolLM2-135M: 9 MB; an 8B model: 0.26 GB, on the device the tensors live on). A delta carries each changed element as
its flat index (int32) and its new value: 6 bytes per element in bf16 against 2 for the whole
tensor, so it pays below a third of the elements changed (half in fp32). `DeltaEncoder` decides per
tensor and sends the tensor whole where the delta would not be smaller, so a delta push is never
larger than a full one.

The wire form of a delta is one int32 tensor named `<name>` + `DELTA_SUFFIX`: [n, n flat indices,
the n new values' bytes (padded to 4)], one tensor so that it never splits across buckets.

Invariants:
- Overwrite, not add: a delta sets elements to their new values, so applying it twice, or after a
  retried bucket, gives the same weights (idempotent).
- Exact: an element counts as changed when its bits differ (compared as integers of its size,
  which is also 2.7x faster than a bf16 comparison on the CPU), so the replica's copy ends bit-for-
  bit the sender's, -0.0 and NaN payloads included.
- Both ends keep the last state they agreed on, in the replicas' dtype: the encoder what it last
  sent (its base), each replica what it last loaded (the decoder's base). A delta is only correct
  against the same base, so a push is a delta only if every target took the previous push
  completely (`DeltaSchedule`, weights/update.py's, whatever sender carries the push): a replica that failed, restarted, or missed
  a push gets a full one, and every `full_every`-th push is full anyway. A decoder without a base for a
  delta's tensor refuses it (`DeltaBaseError`): the sender then drops the replica from the push
  and sends it a full one next.
- Memory: with delta sync each end holds one copy of the weights it syncs, in the replicas' dtype, on the host.
- A replica still loads every tensor, whole (vLLM's layerwise reload needs every weight of a layer
  to process it, and repacks it for the CPU kernels): a delta saves the bytes packed, carried and
  checked, not the replica's loading.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

DELTA_SUFFIX = "#delta"
WHOLE_TENSOR = 4096  # without delta sync: tensors up to this many elements are counted whole ...
STRIDE = 61  # ... larger ones on every STRIDE-th element
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits, by its size


class DeltaBaseError(RuntimeError):
    """A delta arrived for a tensor the replica has no base of (it restarted or missed a sync)."""


def encode_delta(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Flat int32 `index` [n] and `values` [n] -> the one int32 wire tensor (module docstring)."""
    raw = values.contiguous().view(torch.uint8)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return torch.cat([torch.tensor([index.numel()], dtype=torch.int32), index.to(torch.int32), raw.view(torch.int32)])


def decode_delta(wire: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire tensor -> (flat int64 index [n], values [n] of `dtype`)."""
    n = int(wire[0])
    index = wire[1:1 + n].long()
    values = wire[1 + n:].view(torch.uint8)[:n * dtype.itemsize].view(dtype)
    return index, values


class DeltaEncoder:
    """The sender's side: what it last sent, per tensor, and the one exact comparison with it.

    `keep_whole` (delta sync): the base is each tensor whole, on the host, and a push may go as
    deltas against it; else a fixed sample of it (module docstring), on the tensor's device, only
    counted on. `changed` / `compared`: the elements of the last `encode` that differ from the push
    before it, of tensors that push sent too (the count of a sample, without delta sync)."""

    def __init__(self, keep_whole: bool = True) -> None:
        self.keep_whole = keep_whole
        self._base: dict[str, torch.Tensor] = {}  # name -> the tensor as the replicas have it (flat)
        # summed where the tensors are (a GPU's), read to the host once per push, by `changed`
        self._changed: torch.Tensor | int = 0
        self.compared = 0

    @property
    def changed(self) -> int:
        return int(self._changed)

    def encode(self, named_tensors: Iterable[tuple[str, torch.Tensor]], delta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each tensor whole (`delta` False, or no base, or the delta would not be smaller),
        or as its delta against the base (name + DELTA_SUFFIX); the base becomes the new version."""
        if delta and not self.keep_whole:
            raise ValueError("a delta needs the whole base (DeltaEncoder(keep_whole=True))")
        self._changed = self.compared = 0
        for name, tensor in named_tensors:
            flat = tensor.detach().reshape(-1)
            if not self.keep_whole:
                flat = flat if flat.numel() <= WHOLE_TENSOR else flat[::STRIDE]
            else:
                flat = flat.to("cpu")
            base = self._base.get(name)
            if base is None or base.shape != flat.shape or base.dtype != flat.dtype:
                self._base[name] = flat.clone()
                yield name, tensor
                continue
            bits = BITS[flat.element_size()]
            changed = flat.view(bits) != base.view(bits)
            self.compared += flat.numel()
            count = torch.count_nonzero(changed)
            self._changed = self._changed + count
            if not delta or int(count) * (4 + flat.element_size()) >= flat.numel() * flat.element_size():
                base.copy_(flat)  # counted before any index is made: fp32 changes most elements
                yield name, tensor
                continue
            index = changed.nonzero().view(-1)
            values = flat[index]
            base[index] = values
            yield name + DELTA_SUFFIX, encode_delta(index, values)

    def clear(self) -> None:
        """Forget every base: the next push is whole."""
        self._base.clear()


class DeltaSchedule:
    """Which push may be a delta (weights/update.py's, beside its encoder)."""

    def __init__(self, full_every: int) -> None:
        if full_every < 2:
            raise ValueError(f"full_every={full_every}: a delta schedule needs a full push every >= 2 pushes")
        self.full_every = full_every
        self._holding: set[str] = set()  # replicas that hold the encoder's base: they took the last push whole
        self._deltas_since_full = 0

    def begin(self, urls: Iterable[str]) -> bool:
        """A push to `urls` starts: True if it may be a delta. Until `end`, no replica counts as
        holding the base (it moves during the push: an exception mid-push leaves all due a full one)."""
        urls = list(urls)
        delta = bool(urls) and all(u in self._holding for u in urls) and self._deltas_since_full < self.full_every - 1
        self._holding = set()
        return delta

    def end(self, reached: Iterable[str], delta: bool) -> None:
        """The push ended; `reached`: the replicas that took every bucket of it."""
        self._holding = set(reached)
        self._deltas_since_full = self._deltas_since_full + 1 if delta else 0

    def forget(self, urls: Iterable[str]) -> None:
        """These replicas restarted or failed: their next push is full."""
        self._holding -= set(urls)


class DeltaDecoder:
    """A replica's side: what it last loaded, per tensor, and a delta applied to it (an overwrite)."""

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}

    def decode(self, name: str, tensor: torch.Tensor, owned: bool = False) -> tuple[str, torch.Tensor]:
        """(wire name, wire tensor) -> (the HF name, the whole new tensor to load). A whole tensor
        becomes the base (a copy unless `owned`: a carrier's memory is the sender's to rewrite)
        and is returned; a delta overwrites its elements of the base."""
        if not name.endswith(DELTA_SUFFIX):
            self._base[name] = tensor if owned else tensor.clone()
            return name, self._base[name]
        name = name[:-len(DELTA_SUFFIX)]
        base = self._base.get(name)
        if base is None:
            raise DeltaBaseError(f"delta for {name} but this replica holds no base of it (restarted or missed a "
                                 f"sync); it needs a full sync")
        index, values = decode_delta(tensor, base.dtype)
        if index.numel() and int(index.max()) >= base.numel():
            raise ValueError(f"delta for {name} indexes element {int(index.max())} of {base.numel()}")
        base.view(-1)[index] = values
        return name, base

    def clear(self) -> None:
        self._base.clear()
