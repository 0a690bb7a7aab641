"""rollout.max_lag: auto, a staleness bound that follows how off-policy the data really is.

After every step the lag may move by one, using rank 0's measurements of that step:

    KL > lag_kl_target                             -> lag - 1 (down to 0, the synchronous schedule)
    KL <= target and the learner waited for data    -> lag + 1 (up to lag_cap)
    (waited: timing/learner_idle_s > WAIT_FRACTION x timing/step_wall_s)

KL is `staleness/kl_k3_mean`: KL(generator || learner before the update) per trained token
(`algorithms/off_policy.py`). A higher lag lets generation run further ahead, which only helps
while the learner is starved; a falling lag is the brake when samples get too stale. The producer
applies a new lag to the batches it admits from then on (`RolloutProducer.set_max_lag`), so a
batch keeps the lag it was admitted under. Runs with auto are not bit-reproducible: the decision
reads wall-clock waits.
"""
from __future__ import annotations

from dataclasses import dataclass

WAIT_FRACTION = 0.1  # of the step's wall time the learner must have waited for generation to raise the lag
START_LAG = 1


@dataclass
class AdaptiveLag:
    kl_target: float
    cap: int
    lag: int = START_LAG
    reason: str = ""  # why the last change happened

    def update(self, kl: float, learner_wait_s: float, step_s: float) -> bool:
        """Apply the rule above to one step's measurements; True when the lag changed (see `reason`)."""
        if kl > self.kl_target and self.lag > 0:
            self.lag -= 1
            self.reason = f"staleness/kl_k3_mean {kl:.4g} > rollout.lag_kl_target {self.kl_target:g}"
            return True
        if kl <= self.kl_target and learner_wait_s > WAIT_FRACTION * step_s and self.lag < self.cap:
            self.lag += 1
            self.reason = (f"staleness/kl_k3_mean {kl:.4g} <= rollout.lag_kl_target {self.kl_target:g} and the "
                           f"learner waited {learner_wait_s:.2f} s of a {step_s:.2f} s step for generation")
            return True
        return False

    def state_dict(self) -> dict:
        """What a resume needs: the lag in force (the target and cap come from the config)."""
        return {"lag": self.lag}

    def load_state_dict(self, state: dict) -> None:
        self.lag = state["lag"]
