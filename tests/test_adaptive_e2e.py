"""End to end: rollout.max_lag: auto and trainer.auto_balance on the real learner and replica.

The tiny CPU run is generation-bound (generation ~0.5 s, training ~0.2 s a step), so with a KL
target it cannot reach the lag rises and T (updates per batch) rises; with a target every
off-policy step exceeds, the lag falls to 0, the synchronous schedule. Either way every batch is trained no staler
than the lag in force when it was admitted.

A run with both on is killed right after its step-2 checkpoint and resumed: it goes on with the
lag and T in force at the checkpoint (not the config's starting values) and ends with the same
metrics as the uninterrupted run. Both controllers read wall-clock waits, so that run is set up
where their decisions do not hang on timing: step 0's learner waits for all of the first batch's
generation (far above the 10% threshold), which raises the lag 1 -> 2 and T 1 -> 2, both to their
caps (rollout.lag_cap=2, trainer.max_updates_per_batch=2; rollout.max_k = rollout.k keeps K, a
decision on the replicas' wait, fixed); a KL target no step reaches keeps the lag from falling.
The test checks that premise in both runs before it compares them.
"""
import pytest

from tests.e2e_utils import RLOO, STEPS as E2E_STEPS, assert_trained, coin_flip_data, history, metrics, train

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


# both controllers on, each decision at step 0 and then at its cap (module docstring); k=4 in e2e_utils.SMALL
CAPPED_CONTROLLERS = ["rollout.max_lag=auto", "rollout.lag_kl_target=1e6", "rollout.lag_cap=2", "trainer.auto_balance=true",
                      "trainer.max_updates_per_batch=2", "rollout.max_k=4"]


def test_a_killed_and_resumed_run_keeps_the_lag_and_t_and_ends_like_the_uninterrupted_one(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "resumed"
    train(ref_out, *coin_flip_data(ref_out), *RLOO, *CAPPED_CONTROLLERS)
    crashed = train(out, *coin_flip_data(out), *RLOO, *CAPPED_CONTROLLERS,
                    env={"MEGATRON_ASYNC_CRASH_AFTER_CHECKPOINT": "2"}, check=False)
    assert crashed.returncode != 0
    run_dir = out / "cpu_tiny"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    train(out, *coin_flip_data(out), *RLOO, *CAPPED_CONTROLLERS, resume=True)
    ref_dir = ref_out / "cpu_tiny"
    assert_trained(ref_dir, E2E_STEPS)
    assert_trained(run_dir, E2E_STEPS)  # history.json of the resumed run covers steps 0..3
    for hist in (history(ref_dir), history(run_dir)):  # the premise: both moved at step 0 only, to their caps
        assert [hist[s]["rollout/max_lag"] for s in range(E2E_STEPS)] == [1.0, 2.0, 2.0, 2.0], hist
        assert [hist[s]["balance/updates_per_batch"] for s in range(E2E_STEPS)] == [1.0, 2.0, 2.0, 2.0], hist
        assert [hist[s]["balance/k"] for s in range(E2E_STEPS)] == [4.0] * E2E_STEPS
    ref, res = metrics(ref_dir), metrics(run_dir)
    assert [ref["rollout/policy_version"][s] for s in range(E2E_STEPS)] == [0, 0, 1, 1]  # batch 2 admitted under lag 1, batch 3 under 2
    for key in ("reward/mean", "train/loss", "kl/ref", "train/grad_norm", "train/tokens", "rollout/policy_version",
                "rollout/max_lag", "balance/updates_per_batch", "staleness/kl_k3_mean"):
        for step in range(E2E_STEPS):
            assert res[key][step] == pytest.approx(ref[key][step], rel=1e-5, abs=1e-6), (key, step)
    assert res["eval/pass_at_1_after"] == ref["eval/pass_at_1_after"]
