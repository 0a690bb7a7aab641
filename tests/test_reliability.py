"""Faults injected into the real processes (see megatron_async/run/faults.py) and what the run does."""
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e_utils import RLOO, STEPS, assert_trained, coin_flip_data, metrics, train


@pytest.mark.integration
@pytest.mark.slow
def test_nan_step_is_skipped_and_repeated_nans_stop_with_a_checkpoint(tmp_path):
    # one bad step: skipped (weights, optimizer and LR schedule untouched), the run goes on
    train(tmp_path / "once", *coin_flip_data(tmp_path), *RLOO, env={"MEGATRON_ASYNC_NAN_LOSS_STEPS": "1"})
    assert_trained(tmp_path / "once" / "cpu_tiny", skipped=(1,))  # steps 0, 2, 3 trained
    m = metrics(tmp_path / "once" / "cpu_tiny")
    assert [m["train/skipped"][s] for s in range(STEPS)] == [0.0, 1.0, 0.0, 0.0]
    assert all(math.isfinite(m["kl/ref"][s]) for s in (2, 3))  # no NaN reached the weights
    weights = load_file(str(tmp_path / "once" / "cpu_tiny" / "hf_final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())

    # two in a row with trainer.max_bad_steps=2: a clear error, and the last good state saved
    proc = train(tmp_path / "twice", *RLOO, "trainer.max_bad_steps=2",
                 env={"MEGATRON_ASYNC_NAN_LOSS_STEPS": "1,2"}, check=False)
    assert proc.returncode != 0
    assert "2 consecutive learner steps had NaN/inf loss or gradients" in proc.stderr
    ckpt = tmp_path / "twice" / "cpu_tiny" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000003"


def test_a_run_that_trains_on_nothing_but_nan_never_ends_with_exit_0():
    """run/bad_steps.py's BadStepGuard, as Trainer.train calls it after each step: NaN/inf loss or
    gradients (train/skipped) and batches without one reward (all scores NaN/inf or failed) are bad;
    max_bad_steps in a row stop the run, and so does a shorter run whose every step was bad."""
    from megatron_async.run.bad_steps import BadStepGuard
    from tests.batches import scored_batch as batch

    scored, unscored = batch([[1.0, 0.0], [0.0, None]]), batch([[None, None], [None, None]])
    nan_step, trained = {"train/skipped": 1.0}, {"train/skipped": 0.0}
    tied: dict[str, float] = {}  # all prompts tie, no train/*
    steps = [(scored, nan_step), (unscored, {}), (scored, trained), (batch([[1.0, 1.0]]), tied),
             (scored, nan_step), (unscored, {}), (scored, {"train/skipped": 0.5})]
    guard = BadStepGuard(max_bad_steps=3, steps_to_run=10)
    verdicts = [guard.record(step, b, m) for step, (b, m) in enumerate(steps)]
    assert verdicts[:6] == [None] * 6  # two bad, then a trained step and a tied one reset the count
    assert verdicts[6] == ("3 consecutive learner steps had NaN/inf loss or gradients or no sample with a reward "
                           "(steps 4..6; trainer.max_bad_steps=3)")
    short = BadStepGuard(max_bad_steps=3, steps_to_run=2)  # e.g. resumed at step 5 of 7
    assert short.record(5, scored, nan_step) is None
    assert "(steps 5..6, every step of this run; trainer.max_bad_steps=3)" in str(short.record(6, unscored, {}))
    short = BadStepGuard(max_bad_steps=3, steps_to_run=2)
    assert short.record(0, scored, trained) is None and short.record(1, scored, nan_step) is None


def test_tokenizer_that_does_not_fit_the_model_is_refused(tiny_ckpts, tmp_path):
    import json
    import shutil

    from megatron_async.models.base_model import load_tokenizer

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpts["gqa"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["vocab_size"] = 64  # the tokenizer has ~300 tokens
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"bad: the tokenizer has \d+ tokens but config.json has vocab_size=64"):
        load_tokenizer(bad)
    assert load_tokenizer(tiny_ckpts["gqa"]).pad_token_id is not None


@pytest.mark.integration
@pytest.mark.slow
def test_replica_killed_mid_run_loses_no_prompt(tmp_path):
    train(tmp_path, *RLOO, env={"MEGATRON_ASYNC_KILL_REPLICA_AT_BATCH": "2"})
    # synthetic data (not coin flips): its long generations let the kill land mid-generation; the
    # barely trained model gets every reward 0, so there is no learning signal to ask for here (and
    # the weights stay put: see assert_trained)
    assert_trained(tmp_path / "cpu_tiny", learning_signal=False)
    m = metrics(tmp_path / "cpu_tiny")
    # every step trained on exactly prompts_per_step x K samples: nothing lost, nothing doubled
    assert [m["rollout/samples"][s] for s in range(STEPS)] == [8 * 4] * STEPS
    assert m["rollout/replica_restarts"][STEPS - 1] >= 1
    # the restarted replica only generated with current weights: lag stays within the bound
    assert max(m["rollout/lag_max"].values()) <= 1.0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "gloo"])
def test_a_replica_restarted_while_the_learner_trains_is_resynced_and_serves_the_next_version(tmp_path, transport):
    """The trainer's own path (no `forget` by hand): one replica, restarted by the pool between the
    learner's push of v1 and its push of v2 (run/faults.py: killed before step 1 trains, once batch
    2, the last one v1 serves, is generated). The senders still hold its previous process's state:
    over gloo its group (a push through it fails on the new process: the run stopped with
    WeightSyncError), over http with deltas the delta base (with bf16 replicas, whose small steps
    change few elements, the new process refused the delta: `DeltaBaseError`; fp32 here, where a
    step changes nearly every element and a delta push carries whole tensors). The learner re-syncs
    it first (the log line: a whole push through a fresh group), the pool leaves it out of the
    regular push until then, the run goes on, and the restarted replica generates batch 3 with v2.
    NOTE: fp32 because a bf16 CPU run's checkpoint fails in megatron's optimizer sharded state
    ("Param id 10 does not match any model sharded param", seen 2026-12-04 with this tree)."""
    run = tmp_path / "cpu_tiny"
    proc = train(tmp_path, *coin_flip_data(tmp_path), *RLOO, f"rollout.weight_transport={transport}",
                 "rollout.sync_full_every=10", env={"MEGATRON_ASYNC_RESTART_REPLICA_AT_STEP": "1"})
    assert_trained(run)  # coin flips: rewards that differ, so the weights the re-sync carries moved
    m = metrics(run)
    assert m["rollout/replica_restarts"][STEPS - 1] == 1.0
    assert "replicas [0] restarted: pushing the learner's current weights (v2)" in proc.stderr, proc.stderr[-4000:]
    # one replica: batch 3 came from the restarted one, generated with v2 (max_lag=1), as every batch before it
    assert [m["rollout/policy_version"][s] for s in range(STEPS)] == [0.0, 0.0, 1.0, 2.0]
    assert m["weight_sync/delta"][STEPS - 1] == 1.0  # the replica took deltas again after its whole re-sync
