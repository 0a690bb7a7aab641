"""End to end: rollout.max_lag: auto and trainer.auto_balance on the real learner and replica.

The tiny CPU run is generation-bound (generation ~0.5 s, training ~0.2 s a step), so with a KL
target it cannot reach the lag rises and T (updates per batch) rises; with a target every
off-policy step exceeds, the lag falls to 0, the synchronous schedule. Either way every batch is trained no staler
than the lag in force when it was admitted.
"""
import pytest

from tests.e2e_utils import RLOO, assert_trained, coin_flip_data, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # each runs `megatron-async train`

STEPS = 5


@pytest.mark.parametrize("target, direction", [(1.0, "up"), (1e-12, "down")])
def test_the_lag_follows_the_measured_staleness(tmp_path, target, direction):
    # coin-flip answers: rewards that differ within a batch (a learning signal, e2e_utils.assert_trained);
    # on the synthetic task this barely trained model can score 0 on every sample of all 5 steps
    train(tmp_path, *coin_flip_data(tmp_path), *RLOO, f"trainer.steps={STEPS}", "rollout.max_lag=auto", f"rollout.lag_kl_target={target}",
          "rollout.lag_cap=3", "trainer.auto_balance=true", "trainer.max_updates_per_batch=3")
    hist = assert_trained(tmp_path / "cpu_tiny", STEPS)
    lags = [hist[s]["rollout/max_lag"] for s in range(STEPS)]  # the lag in force when step s was logged
    kl = [hist[s]["staleness/kl_k3_mean"] for s in range(STEPS)]
    if direction == "up":
        assert all(k <= target for k in kl) and lags[-1] > lags[0], (lags, kl)
        assert hist[STEPS - 1]["balance/updates_per_batch"] > 1.0  # generation-bound: T rose too
    else:
        # each step whose KL exceeds the target lowers the lag by one (step 0's batch is exactly
        # on-policy, KL 0, and a starved learner may raise it first), down to 0: synchronous
        assert all(lags[s + 1] == max(0.0, lags[s] - 1) for s in range(STEPS - 1) if kl[s] > target), (lags, kl)
        assert lags[-1] == 0.0, (lags, kl)
    # admission: a batch is never staler than the largest lag in force before it was trained
    for s in range(STEPS):
        assert hist[s]["rollout/lag_max"] <= max([1.0] + lags[:s]), (s, hist[s]["rollout/lag_max"], lags)
