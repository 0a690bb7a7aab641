"""`BadStepGuard`: a run that learns nothing but NaN stops with an error, never with exit 0."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_async.rollout.producer import RolloutBatch


@dataclass
class BadStepGuard:
    """Stops a run that learns nothing but NaN. A step is bad when the learner skipped an optimizer
    step for a NaN/inf loss or gradient (`train/skipped` > 0: weights untouched) or when no sample
    of its batch kept a reward (every score NaN/inf or failed, dropped under reward.on_error=drop:
    nothing to train on). `trainer.max_bad_steps` bad steps in a row stop the run; so does a run
    that ends with every one of its steps bad, though fewer than that: such a run never exits 0.
    Steps with nothing to train on because every prompt's rewards tie are not bad: they are a
    learning signal's absence, not a numerical failure (counted in the algorithms' metrics)."""

    max_bad_steps: int
    steps_to_run: int  # this run's steps (after a resume: those left)
    in_a_row: int = 0

    def record(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> str | None:
        """Count learner step `step` (its batch and metrics) -> why the run must stop now, or None."""
        no_reward = not batch.scored()
        self.in_a_row = self.in_a_row + 1 if metrics.get("train/skipped", 0.0) > 0 or no_reward else 0
        if self.in_a_row < min(self.max_bad_steps, self.steps_to_run):
            return None
        every = ", every step of this run" if self.in_a_row < self.max_bad_steps else ""
        return (f"{self.in_a_row} consecutive learner steps had NaN/inf loss or gradients or no sample with a "
                f"reward (steps {step + 1 - self.in_a_row}..{step}{every}; trainer.max_bad_steps={self.max_bad_steps})")
