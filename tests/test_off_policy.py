"""GRPO, the off-policy corrections and the staleness statistics against hand computation; the
adaptive lag's schedule and the producer's admission under a lag that changes (pure logic)."""
import math
import threading
import time

import pytest
import torch

from megatron_async.algorithms import ALGORITHMS, Algorithm
from megatron_async.algorithms.base import attach
from megatron_async.algorithms.losses import group_advantages
from megatron_async.algorithms.off_policy import Correction, behaviour_weights, sequence_weights, staleness_stats
from megatron_async.algorithms.ppo import PPO
from megatron_async.config import ConfigError, TrainerConfig, load_config
from megatron_async.rollout.producer import RolloutBatch, RolloutProducer
from megatron_async.run.adaptive_lag import AdaptiveLag
from megatron_async.sample import Sample


K = 2  # completions per prompt of the batches these tests build


def algo(name: str, correction: Correction = "none", **trainer) -> Algorithm:
    return ALGORITHMS[name](TrainerConfig(algorithm=name, **trainer), correction)


def sample(prompt, reward, n=2, lp=-1.0):
    return Sample(prompt_index=prompt, prompt_token_ids=[5, 6], token_ids=[7] * n, logprobs=[lp] * n, reward=reward,
                  policy_version=0)


class OldModels:
    """Reference logprobs 0; the learner before the update as given (`old`)."""

    def __init__(self, old):
        self.old = old

    def reference_logprobs(self, mbs):
        return [torch.zeros(mb["input_ids"].shape) for mb in mbs]

    def policy_logprobs(self, mbs):
        return self.old

    def values(self, mbs):
        raise AssertionError("no value model here")


# ----------------------------------------------------------------------------- the weights


def test_behaviour_weights_truncate_or_drop_by_the_ratio_to_the_generator():
    gen = torch.zeros(1, 4)
    old = torch.log(torch.tensor([[0.3, 1.0, 1.5, 4.0]]))  # pi_prox / mu per token
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    caps = dict(cap=2.0, low=0.5, high=2.0)
    torch.testing.assert_close(behaviour_weights(old, gen, mask, "none", **caps), torch.ones(1, 4))
    torch.testing.assert_close(behaviour_weights(old, gen, mask, "tis", **caps), torch.tensor([[0.3, 1.0, 1.5, 2.0]]))
    torch.testing.assert_close(behaviour_weights(old, gen, mask, "icepop", **caps), torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    torch.testing.assert_close(behaviour_weights(old, gen, mask, "decoupled", **caps), torch.tensor([[0.3, 1.0, 1.5, 0.0]]))
    seq = sequence_weights(old, gen, mask, "tis", **caps)  # prod = 0.3 * 1 * 1.5 * 4 = 1.8
    assert seq.tolist() == pytest.approx([1.8])


def test_staleness_statistics_match_hand_computation():
    gen = torch.zeros(1, 3)
    r = [0.5, 1.0, 2.0]
    old = torch.log(torch.tensor([r]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not trained on
    s = {k: float(v) for k, v in staleness_stats(old, gen, mask).items()}
    k3 = [(x - 1) - math.log(x) for x in r[:2]]
    assert s["staleness/kl_k3_mean"] == pytest.approx(sum(k3) / 2)
    assert s["staleness/kl_k3_max"] == pytest.approx(max(k3))
    assert s["staleness/iw_mean"] == pytest.approx(0.75) and s["staleness/iw_max"] == pytest.approx(1.0)
    assert s["staleness/ess_fraction"] == pytest.approx(1.5 ** 2 / (2 * (0.25 + 1.0)))
    same = {k: float(v) for k, v in staleness_stats(gen, gen, mask).items()}  # on-policy
    assert same["staleness/kl_k3_mean"] == 0.0 and same["staleness/ess_fraction"] == pytest.approx(1.0)


def test_tis_weights_reach_the_ppo_loss_and_none_leaves_it_alone():
    rows = [sample(0, 1.0), sample(0, 0.0)]
    corrections: tuple[Correction, ...] = ("none", "tis")
    for correction in corrections:
        ppo = PPO(TrainerConfig(algorithm="ppo", beta=0.0, gamma=1.0, lam=1.0), correction)
        mbs = ppo.microbatches(rows, pad_id=0, micro_batch_size=2)
        old = [mbs[0]["gen_logprobs"] + torch.log(torch.tensor(3.0)) * mbs[0]["loss_mask"]]  # w = 3 -> tis caps at 2
        attach(mbs, "old_values", [torch.zeros(mb["input_ids"].shape) for mb in mbs])
        stats = Algorithm.prepare(ppo, [mbs], OldModels(old), K)  # the shared part of PPO.prepare (no value model)
        ppo.add_advantages(mbs)
        mb = mbs[0]
        loss, _ = ppo.loss(old[0].clone(), mb)  # ratio 1: loss = -mean over tokens of w * A
        adv = mb["advantages"][mb["loss_mask"] > 0]
        w = 2.0 if correction == "tis" else 1.0
        assert float(loss) == pytest.approx(float(-(w * adv).mean() * mb["loss_scale"]), abs=1e-6)
        assert float(stats["staleness/iw_mean"]) == pytest.approx(3.0)


# ----------------------------------------------------------------------------- GRPO


def test_grpo_advantages_with_and_without_std_normalisation():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0])
    plain = group_advantages(r, 4, normalise_std=False)
    assert plain.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 1.0, 1.0, -1.0, -1.0])
    std = torch.tensor([0.5, 2 / math.sqrt(3)])  # unbiased std of each group
    normed = group_advantages(r, 4, normalise_std=True)
    assert normed.tolist() == pytest.approx((plain.view(2, 4) / (std[:, None] + 1e-4)).flatten().tolist())


def test_grpo_skips_and_counts_groups_whose_rewards_all_tie():
    grpo = algo("grpo")
    rows, stats = grpo.select([sample(0, 1.0), sample(0, 0.0), sample(1, 1.0), sample(1, 1.0), sample(2, 0.0)], K)
    assert [r.prompt_index for r in rows] == [0, 0]
    assert stats["grpo/tied_groups"] == 1.0 and stats["group/incomplete_prompts"] == 1.0


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_grpo_loss_clips_asymmetrically_and_aggregates_as_asked(aggregation):
    grpo = algo("grpo", clip_eps=0.2, clip_eps_high=0.5, loss_aggregation=aggregation, grpo_std_normalization=False)
    rows, _ = grpo.select([sample(0, 1.0, n=1), sample(0, 0.0, n=3)], K)
    mbs = grpo.microbatches(rows, pad_id=0, micro_batch_size=2)
    grpo.prepare([mbs], OldModels([torch.zeros(mbs[0]["input_ids"].shape)]), K)
    mb = mbs[0]
    assert mb["advantages"].tolist() == pytest.approx([0.5, -0.5])
    lp = torch.log(torch.full(mb["input_ids"].shape, 1.4)) * mb["loss_mask"]  # ratio 1.4 on every token
    loss, m = grpo.loss(lp, mb)
    # row 0 (A = +0.5): clip-higher lets 1.4 through: -0.7; row 1 (A = -0.5): max(0.7, 0.5 * 1.2) = 0.7
    per_row = {"token": (-0.7 * 1 + 0.7 * 3) / 4, "sequence": (-0.7 + 0.7) / 2}[aggregation]
    assert float(loss) == pytest.approx(per_row * float(mb["loss_scale"]), abs=1e-6)
    assert float(m["policy/clipfrac"]) == 0.0  # neither term is the clipped one


def test_grpo_kl_term_is_k3_to_the_reference():
    grpo = algo("grpo", grpo_kl_coef=0.5)
    rows, _ = grpo.select([sample(0, 1.0, n=1), sample(0, 0.0, n=1)], K)
    mbs = grpo.microbatches(rows, pad_id=0, micro_batch_size=2)
    grpo.prepare([mbs], OldModels([torch.zeros(mbs[0]["input_ids"].shape)]), K)
    lp = -0.1 * mbs[0]["loss_mask"]
    attach(mbs, "old_logprobs", [lp.clone() for _ in mbs])  # ratio 1
    loss, m = grpo.loss(lp, mbs[0])
    k3 = math.exp(0.1) - 0.1 - 1  # ref 0, logp -0.1
    assert float(m["policy/kl_k3_ref"]) == pytest.approx(k3, rel=1e-5)
    adv = mbs[0]["advantages"]
    assert float(loss) == pytest.approx(float((-adv.mean() + 0.5 * k3) * mbs[0]["loss_scale"]), rel=1e-5)


# ----------------------------------------------------------------------------- the lag


def test_adaptive_lag_rises_while_starved_and_under_target_and_falls_over_it():
    lag = AdaptiveLag(kl_target=0.01, cap=3)
    assert lag.lag == 1
    assert lag.update(kl=0.001, learner_wait_s=0.5, step_s=2.0) and lag.lag == 2 and "waited" in lag.reason
    assert not lag.update(kl=0.001, learner_wait_s=0.0, step_s=2.0)  # not starved: stays
    assert lag.update(kl=0.001, learner_wait_s=1.0, step_s=2.0) and lag.lag == 3
    assert not lag.update(kl=0.001, learner_wait_s=1.0, step_s=2.0) and lag.lag == 3  # the cap
    assert lag.update(kl=0.05, learner_wait_s=1.0, step_s=2.0) and lag.lag == 2 and "> rollout.lag_kl_target" in lag.reason
    lag.lag = 0
    assert not lag.update(kl=0.05, learner_wait_s=0.0, step_s=2.0) and lag.lag == 0  # the floor


def test_admission_stays_exact_when_the_lag_changes_between_batches():
    """Every batch is trained no staler than the lag in force when it was admitted, and the
    learner never changes the weights under a batch in flight."""
    admitted: dict[int, int] = {}
    held = {"version": 0}  # held: what the replicas hold (the learner's last push)
    gate = threading.Event()

    def make_batch(index):
        admitted[index] = prod.max_lag
        version = held["version"]  # the completions report the weights they were sampled under
        if index == 3:
            gate.wait(5)  # batch 3 is in flight while the learner asks to push
        return RolloutBatch(index=index, policy_version=version, problems=[], samples=[])

    prod = RolloutProducer(make_batch, max_lag=2, last_batch=7)
    prod.start()
    try:
        for step in range(8):
            deadline = time.monotonic() + 10
            while not prod.has(step):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            batch = prod.take(step)
            assert step - batch.policy_version <= admitted[step], (step, batch.policy_version, admitted[step])
            if step == 1:
                while 3 not in admitted:  # batch 3 (version 1, admitted under lag 2) starts
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                prod.set_max_lag(0)  # e.g. the KL rose over the target
                assert not prod.old_weights_done(1)  # batch 3 (admitted under lag 2, version 1) is in flight
                gate.set()
            while not prod.old_weights_done(step):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            held["version"] = step + 1
            prod.notify_synced(step + 1)
        assert admitted[2] == 2 and admitted[5] == 0
    finally:
        gate.set()
        prod.stop()


def test_auto_lag_and_correction_keys_are_checked():
    assert load_config(None, ["rollout.max_lag=auto"]).rollout.max_lag == "auto"
    with pytest.raises(ConfigError, match="rollout.max_lag"):
        load_config(None, ["rollout.max_lag=sometimes"])
    with pytest.raises(ConfigError, match="trainer.staleness_monitor"):
        load_config(None, ["rollout.max_lag=auto", "trainer.staleness_monitor=false"])
    with pytest.raises(ConfigError, match="trainer.icepop_low"):
        load_config(None, ["trainer.icepop_low=3"])
    from megatron_async.algorithms.off_policy import resolve_correction

    assert resolve_correction(load_config(None, ["rollout.max_lag=0"])) == "none"
    assert resolve_correction(load_config(None, [])) == "tis"
    assert resolve_correction(load_config(None, ["trainer.off_policy_correction=icepop"])) == "icepop"


def test_auto_balance_raises_t_when_generation_bound_and_k_when_training_bound():
    from megatron_async.run.auto_balance import AutoBalance

    b = AutoBalance(updates=1, k=4, max_updates=2, max_k=5)
    assert b.update(learner_wait_s=1.0, replica_wait_s=0.0, step_s=2.0) and (b.updates, b.k) == (2, 4)
    assert "generation-bound" in b.reason
    assert not b.update(learner_wait_s=1.0, replica_wait_s=0.0, step_s=2.0)  # T at its bound
    assert b.update(learner_wait_s=0.0, replica_wait_s=0.5, step_s=2.0) and (b.updates, b.k) == (2, 5)
    assert "training-bound" in b.reason
    assert not b.update(learner_wait_s=0.05, replica_wait_s=0.05, step_s=2.0)  # balanced: nothing moves
    with pytest.raises(ConfigError, match="rollout.max_k"):
        load_config(None, ["trainer.auto_balance=true", "rollout.k=8", "rollout.max_k=4"])
