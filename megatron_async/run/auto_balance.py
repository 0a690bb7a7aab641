"""trainer.auto_balance: the paper's Section 4 as a feature: use the side that waits.

After every step, from rank 0's timings of that step (one change at most):

    generation-bound (the learner waited for data):   T (updates per batch) + 1, up to trainer.max_updates_per_batch
    training-bound (the replicas waited for weights): K (completions per prompt) + 1, up to rollout.max_k
    (waited: more than WAIT_FRACTION of the step's wall time)

More passes over each batch use the idle learner (the paper's T knob); more samples per prompt use
idle replicas and give Online DPO better pairs and RLOO / GRPO better baselines (its K knob). A
new T applies from the next learner step, a new K to batches generated from then on. Departure:
the LR schedule keeps the optimizer-step count planned from the initial T, so with a higher T it
reaches trainer.min_lr early and stays there. Off by default; like max_lag: auto, runs with it
are not bit-reproducible (the decision reads wall-clock waits).
"""
from __future__ import annotations

from dataclasses import dataclass

WAIT_FRACTION = 0.1


@dataclass
class AutoBalance:
    updates: int  # T in force
    k: int  # K in force
    max_updates: int
    max_k: int
    reason: str = ""  # why the last change happened

    def update(self, learner_wait_s: float, replica_wait_s: float, step_s: float) -> bool:
        """Apply the rule above to one step's waits; True when T or K changed (see `reason`)."""
        if learner_wait_s > WAIT_FRACTION * step_s and self.updates < self.max_updates:
            self.updates += 1
            self.reason = (f"generation-bound: the learner waited {learner_wait_s:.2f} s of a {step_s:.2f} s step; "
                           f"T -> {self.updates}")
            return True
        if replica_wait_s > WAIT_FRACTION * step_s and self.k < self.max_k:
            self.k += 1
            self.reason = (f"training-bound: the replicas waited {replica_wait_s:.2f} s of a {step_s:.2f} s step; "
                           f"K -> {self.k}")
            return True
        return False

    def state_dict(self) -> dict:
        """What a resume needs: T and K in force (their bounds come from the config)."""
        return {"updates": self.updates, "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.k = state["updates"], state["k"]
