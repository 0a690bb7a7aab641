"""Wall-clock spans of one step, by name, instead of hand-paired `time.monotonic()` calls."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class StepTimer:
    """`with timer("train"): ...` adds the span's seconds to `timer.seconds["train"]`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def metrics(self, prefix: str = "timing/") -> dict[str, float]:
        """{"timing/<name>_s": seconds} of every span timed so far."""
        return {f"{prefix}{name}_s": s for name, s in self.seconds.items()}
