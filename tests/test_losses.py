"""Each loss against values worked out by hand with math.log / math.exp on small explicit numbers."""
import math

import pytest
import torch

from megatron_async.algorithms.losses import (
    best_of_k_sft_loss,
    dpo_loss,
    gae,
    kl_penalized_rewards,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    proximal_rloo_loss,
    rloo_advantages,
    rloo_loss,
    sequence_kl,
    sequence_logprobs,
)

T = torch.tensor


def grad(t: torch.Tensor) -> torch.Tensor:
    """t's gradient, after a backward that reached it."""
    assert t.grad is not None
    return t.grad


def test_sequence_logprobs_and_kl_sum_only_masked_tokens():
    logp = T([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0]])
    ref = T([[-9.0, -1.0, -2.0], [-1.0, -0.5, -9.0]])
    mask = T([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert sequence_logprobs(logp, mask).tolist() == [-5.0, -0.75]
    # row 0: (-2 - -1) + (-3 - -2) = -2 ; row 1: (-0.5 - -1) + (-0.25 - -0.5) = 0.75
    assert sequence_kl(logp, ref, mask).tolist() == [-2.0, 0.75]


def test_dpo_sigmoid_matches_hand_values():
    pc, pr, rc, rr = T([-3.0, -6.0]), T([-5.0, -2.0]), T([-4.0, -6.0]), T([-4.5, -3.0])
    beta = 0.1
    # pair 0: h = (-3 - -4) - (-5 - -4.5) = 1.5 ; pair 1: h = 0 - 1 = -1
    expected = (-math.log(1 / (1 + math.exp(-0.15))) - math.log(1 / (1 + math.exp(0.1)))) / 2
    loss, m = dpo_loss(pc, pr, rc, rr, beta)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx((0.1 * 1.0 + 0.1 * 0.0) / 2)
    assert m["rewards/rejected"].item() == pytest.approx((0.1 * -0.5 + 0.1 * 1.0) / 2)
    assert m["rewards/margin"].item() == pytest.approx((0.15 - 0.1) / 2)
    assert m["rewards/accuracy"].item() == 0.5


def test_dpo_ipo_matches_hand_values():
    pc, pr, rc, rr = T([-3.0]), T([-5.0]), T([-4.0]), T([-4.5])
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="ipo")
    assert loss.item() == pytest.approx((1.5 - 1 / (2 * 0.25)) ** 2)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = T([-3.0], requires_grad=True), T([-5.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, T([-3.0]), T([-5.0]), beta=0.5)
    loss.backward()
    # at h = 0: d/dpc = -beta * sigmoid(0) = -0.25
    assert grad(pc).item() == pytest.approx(-0.25)
    assert grad(pr).item() == pytest.approx(0.25)


def test_dpo_rejects_bad_options():
    x = T([0.0])
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, 0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, 0.0)


def test_kl_penalized_rewards_puts_score_on_last_completion_token():
    policy = T([[-1.0, -1.0, -2.0, -7.0], [-1.0, -0.5, -0.5, -1.0]])
    ref = T([[-1.0, -1.5, -1.0, -1.0], [-1.0, -1.0, -1.0, -2.0]])
    mask = T([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    r = kl_penalized_rewards(T([1.0, 2.0]), policy, ref, mask, kl_coef=0.1)
    expected = [
        [0.0, -0.1 * 0.5, -0.1 * -1.0 + 1.0, 0.0],
        [0.0, -0.1 * 0.5, -0.1 * 0.5, -0.1 * 1.0 + 2.0],
    ]
    for got, want in zip(r.tolist(), expected):
        assert got == pytest.approx(want)


def test_kl_penalized_rewards_rejects_empty_completion():
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="all zero"):
        kl_penalized_rewards(T([1.0]), z, z, z, 0.1)


def test_gae_matches_hand_recursion():
    g, lam = 0.9, 0.8
    r1, r2, r3 = 0.1, -0.2, 1.0
    v1, v2, v3 = 0.5, 0.3, 0.7
    rewards = T([[0.0, r1, r2, r3, 0.0]])
    values = T([[9.0, v1, v2, v3, 9.0]])  # values off the mask must not leak in
    mask = T([[0.0, 1.0, 1.0, 1.0, 0.0]])
    a3 = r3 - v3
    a2 = r2 + g * v3 - v2 + g * lam * a3
    a1 = r1 + g * v2 - v1 + g * lam * a2
    adv, ret = gae(rewards, values, mask, g, lam)
    assert adv[0].tolist() == pytest.approx([0.0, a1, a2, a3, 0.0])
    assert ret[0].tolist() == pytest.approx([0.0, a1 + v1, a2 + v2, a3 + v3, 0.0])


def test_gae_with_gamma_lam_one_and_zero_values_is_reward_to_go():
    rewards = T([[1.0, 2.0, 3.0], [0.0, 5.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv, _ = gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    assert adv.tolist() == [[6.0, 5.0, 3.0], [0.0, 5.0, 0.0]]


def test_gae_rejects_mask_with_hole():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="contiguous"):
        gae(x, x, T([[1.0, 0.0, 1.0, 0.0]]), 1.0, 1.0)


def test_masked_whiten_normalises_masked_entries_only():
    x = T([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    std = math.sqrt(((1 - 2.5) ** 2 + (2 - 2.5) ** 2 + (3 - 2.5) ** 2 + (4 - 2.5) ** 2) / 4)
    assert w.tolist()[0] == pytest.approx([(1 - 2.5) / std, (2 - 2.5) / std, 0.0], rel=1e-5)
    assert w[1, 2].item() == 0.0


def test_ppo_policy_loss_clips_per_token():
    old = T([[0.0, math.log(0.5), math.log(0.5), math.log(0.5)]])
    new = T([[5.0, math.log(0.75), math.log(0.25), math.log(0.55)]])  # ratios 1.5, 0.5, 1.1
    adv = T([[7.0, 2.0, -1.0, 3.0]])
    mask = T([[0.0, 1.0, 1.0, 1.0]])
    # token 1: A>0, r=1.5 -> clipped to 1.2: max(-3, -2.4) = -2.4
    # token 2: A<0, r=0.5 -> clipped to 0.8: max(0.5, 0.8) = 0.8
    # token 3: A>0, r=1.1 inside the range: -3.3
    loss, m = ppo_policy_loss(new, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx((-2.4 + 0.8 - 3.3) / 3, rel=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 3)
    lr = [math.log(1.5), math.log(0.5), math.log(1.1)]
    assert m["policy/approx_kl"].item() == pytest.approx(sum(0.5 * x * x for x in lr) / 3, rel=1e-5)


def test_ppo_policy_loss_has_no_gradient_on_clipped_tokens():
    old = T([[math.log(0.5), math.log(0.5)]])
    new = T([[math.log(0.75), math.log(0.55)]], requires_grad=True)
    loss, _ = ppo_policy_loss(new, old, T([[1.0, 1.0]]), torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert grad(new)[0, 0].item() == 0.0
    assert grad(new)[0, 1].item() == pytest.approx(-1.1 / 2)  # d(-A r)/dlogp = -A r, over 2 tokens


def test_ppo_value_loss_clipped():
    values, old, returns = T([[1.0, 0.0, 2.0]]), T([[0.5, 0.0, 1.9]]), T([[0.0, 3.0, 2.0]])
    mask = T([[1.0, 0.0, 1.0]])
    # token 0: unclipped (1-0)^2=1, clipped 0.5+0.2=0.7 -> 0.49; max 1
    # token 2: unclipped 0, clipped 1.9+0.1=2.0 -> 0; max 0
    loss, m = ppo_value_loss(values, old, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    assert m["value/mean"].item() == pytest.approx(1.5)


def test_rloo_advantages_leave_one_out():
    adv = rloo_advantages(T([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.2, 0.4, 3.0]), k=3)
    expected = [1.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.2 - 1.7, 0.4 - 1.6, 3.0 - 0.3]
    assert adv.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("k", [0, 1])
def test_rloo_needs_two_samples(k):
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(T([1.0, 2.0]), k=k)


def test_rloo_rejects_incomplete_groups():
    with pytest.raises(ValueError, match="divisible"):
        rloo_advantages(T([1.0, 2.0, 3.0]), k=2)


def test_rloo_loss_is_advantage_weighted_sequence_nll():
    logp = T([[-1.0, -2.0, 0.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = T([2.0, -1.0])
    loss, _ = rloo_loss(logp, mask, adv)
    assert loss.item() == pytest.approx(-(2.0 * -3.0 + -1.0 * -1.0) / 2)
    loss.backward()
    assert grad(logp).tolist() == [[-1.0, -1.0, 0.0], [0.5, 0.5, 0.0]]


def test_proximal_rloo_clips_sequence_ratio():
    gen = T([[-1.0, -1.0], [-1.0, -1.0], [-2.0, -2.0]])
    # sequence log-ratios: log 1.5, log 1.5, log 1.1
    new = T([[-1.0 + math.log(1.5), -1.0], [-1.0, -1.0 + math.log(1.5)], [-2.0 + math.log(1.1), -2.0]])
    new.requires_grad_(True)
    mask = torch.ones(3, 2)
    adv = T([2.0, -1.0, 1.0])
    # seq 0: A>0, rho 1.5 -> max(-3, -2.4) = -2.4 (clipped, no gradient)
    # seq 1: A<0, rho 1.5 -> max(1.5, 1.2) = 1.5 (unclipped)
    # seq 2: inside: -1.1
    loss, m = proximal_rloo_loss(new, gen, mask, adv, clip_eps=0.2)
    assert loss.item() == pytest.approx((-2.4 + 1.5 - 1.1) / 3, rel=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(1 / 3)
    assert m["policy/ratio"].item() == pytest.approx((1.5 + 1.5 + 1.1) / 3, rel=1e-6)
    loss.backward()
    assert grad(new)[0].tolist() == [0.0, 0.0]
    # d(-A rho)/dlogp_t = -A rho for every token of the sequence, / 3 sequences
    assert grad(new)[1].tolist() == pytest.approx([1.5 / 3, 1.5 / 3])
    assert grad(new)[2].tolist() == pytest.approx([-1.1 / 3, -1.1 / 3])


def test_proximal_rloo_equals_rloo_gradient_on_policy():
    """With pi_theta == pi_gen the ratio is 1 and the gradient is REINFORCE's."""
    logp = T([[-1.0, -2.0], [-0.5, -0.3]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    adv = T([0.7, -0.4])
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    proximal_rloo_loss(a, logp, mask, adv, clip_eps=0.2)[0].backward()
    rloo_loss(b, mask, adv)[0].backward()
    assert torch.allclose(grad(a), grad(b))


def test_best_of_k_sft_loss_is_token_mean_nll():
    logp = T([[-9.0, -1.0, -2.0], [-9.0, -0.5, -9.0]])
    mask = T([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    loss, m = best_of_k_sft_loss(logp, mask)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    assert m["sft/tokens"].item() == 3.0
