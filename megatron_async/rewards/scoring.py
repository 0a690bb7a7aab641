"""Score (prompt, completion, reference) triples with a per-sample timeout; failures are recorded.

A reward that could not be computed is NOT a reward of 0: training on it would teach the policy
that whatever it wrote is wrong (the rule other RLHF systems state too: never turn a failed
generation into a zero-reward sample). Each sample therefore ends as exactly one of
  - a finite float reward,
  - an error (the scorer raised, or returned something that is not a finite number), or
  - a timeout (the scorer did not return within `timeout_s`).
`ScoreReport` keeps all three and counts errors and timeouts for the step metrics. The policy
`on_error` says what to do with failures: "drop" keeps them in the report with reward None for
the caller to remove (`ScoreReport.kept`), "stop" raises `ScoringError` naming the first failed
sample.

NOTE (threads): each sample runs in a daemon thread and the caller waits on it with a deadline.
Python cannot kill a thread, so a scorer that hangs forever keeps its thread (daemon, so it never
blocks interpreter exit) and only its sample is marked as timed out. Scorers must therefore be
side-effect free; anything that can hang for real or runs untrusted code belongs in a worker
process (see `reward_model.py`).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

ON_ERROR = ("drop", "stop")
ScoreFn = Callable[[str, str, str | None], float]  # (prompt, completion, reference)


class ScoringError(RuntimeError):
    """Raised under on_error="stop" when a sample could not be scored."""


@dataclass
class SampleScore:
    """The outcome for sample `index`: a reward, or why there is none."""

    index: int
    reward: float | None = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.reward is not None


@dataclass
class ScoreReport:
    scores: list[SampleScore]

    @property
    def n_errors(self) -> int:
        return sum(s.error is not None and not s.timed_out for s in self.scores)

    @property
    def n_timeouts(self) -> int:
        return sum(s.timed_out for s in self.scores)

    def kept(self) -> list[SampleScore]:
        """The samples that have a reward, in input order."""
        return [s for s in self.scores if s.ok]

    def metrics(self) -> dict[str, float]:
        return {"reward/errors": float(self.n_errors), "reward/timeouts": float(self.n_timeouts)}

    def enforce(self, on_error: str, what: Sequence[str] | None = None) -> "ScoreReport":
        """Apply the on_error policy: "stop" raises on the first failure, "drop" returns self.

        `what` (optional) names the samples in the error message, e.g. their completions.
        """
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        failed = [s for s in self.scores if not s.ok]
        if failed and on_error == "stop":
            s = failed[0]
            reason = f"timed out ({s.error})" if s.timed_out else f"error: {s.error}"
            name = f" {what[s.index][:120]!r}" if what is not None else ""
            raise ScoringError(
                f"could not score sample {s.index}{name}: {reason} "
                f"({self.n_errors} errors, {self.n_timeouts} timeouts in a batch of {len(self.scores)}; "
                f"set on_error='drop' to train on the rest)"
            )
        return self


def _finite_reward(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"scorer returned {type(value).__name__}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"scorer returned a non-finite reward {value!r}")
    return float(value)


def score_samples(
    samples: Sequence[tuple[str, str, str | None]],
    score_fn: ScoreFn,
    timeout_s: float = 5.0,
    on_error: str = "drop",
    max_workers: int = 8,
) -> ScoreReport:
    """Score each (prompt, completion, reference) with score_fn, at most `max_workers` at a time,
    each given `timeout_s` seconds from its start. Returns the report after applying on_error."""
    if on_error not in ON_ERROR:  # fail before doing the work, not after
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    scores = [SampleScore(index=i) for i in range(len(samples))]

    def run(slot: SampleScore) -> None:
        # Writes go to `slot`, the object captured at start, never to scores[i]: a timed-out
        # sample's slot is replaced, so a late result cannot land in the report.
        try:
            slot.reward = _finite_reward(score_fn(*samples[slot.index]))
        except Exception as e:  # recorded, never swallowed: see the module docstring
            slot.error = f"{type(e).__name__}: {e}"

    for start in range(0, len(samples), max_workers):
        chunk = range(start, min(start + max_workers, len(samples)))
        threads = [threading.Thread(target=run, args=(scores[i],), daemon=True) for i in chunk]
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.start()
        for i, t in zip(chunk, threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                scores[i] = SampleScore(index=i, error=f"no result after {timeout_s:g} s", timed_out=True)
    report = ScoreReport(scores)
    return report.enforce(on_error, what=[c for _, c, _ in samples])
