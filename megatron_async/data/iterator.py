"""A deterministic, resumable, per-epoch shuffled iterator over prompts.

Epoch e visits every item once, in the order `permutation(seed, e)`; the state is just
(epoch, position), so a checkpoint restores the exact next item: nothing skipped, nothing repeated.

NOTE: the state counts items HANDED OUT. Prompts handed to generation but not yet trained on at
checkpoint time are the rollout buffer's to save (users of other RLHF systems have reported resumes
that dropped buffered rollouts or skipped prompts; docs/checkpoints.md); this iterator does not
take them back.
"""
from __future__ import annotations

from typing import Generic, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


class PromptIterator(Generic[T]):
    def __init__(self, items: Sequence[T], seed: int, shuffle: bool = True):
        if len(items) == 0:
            raise ValueError("PromptIterator needs at least one item")
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        # Seeded by (seed, epoch) alone, so an epoch's order never depends on how we got there.
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def __iter__(self) -> "PromptIterator[T]":
        return self

    def __next__(self) -> T:
        if self.position == len(self.items):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        item = self.items[int(self._order[self.position])]
        self.position += 1
        return item

    def take(self, n: int) -> list[T]:
        """The next n items (crossing into the next epoch when needed)."""
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle, "num_items": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved position. The data and the seed must be the ones it was saved with."""
        for key, have in (("seed", self.seed), ("shuffle", self.shuffle), ("num_items", len(self.items))):
            if key not in state:
                raise ValueError(f"prompt iterator state: missing key {key!r}")
            if state[key] != have:
                raise ValueError(
                    f"prompt iterator state: {key}={state[key]!r} was saved, but this run has {key}={have!r}; "
                    "resuming would skip or repeat prompts"
                )
        if not 0 <= state["position"] <= len(self.items) or state["epoch"] < 0:
            raise ValueError(f"prompt iterator state: epoch={state['epoch']}, position={state['position']} out of range")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._order_of(self.epoch)
