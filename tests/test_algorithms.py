"""Per-algorithm row selection, microbatching and loss weighting (pure tensors, no engines)."""
import math
from typing import cast

import pytest
import torch

from megatron_async import algorithms
from megatron_async.algorithms import ALGORITHMS
from megatron_async.algorithms.base import Algorithm, Microbatch, attach
from megatron_async.config import TrainerConfig
from megatron_async.algorithms.losses import dpo_loss, sequence_logprobs
from megatron_async.algorithms.ppo import PPO
from megatron_async.sample import Sample


K = 2  # completions per prompt of the batches these tests build


def algo(name: str, **trainer) -> Algorithm:
    return ALGORITHMS[name](TrainerConfig(algorithm=name, **trainer))


def ppo_algo(**trainer) -> PPO:
    return PPO(TrainerConfig(algorithm="ppo", **trainer))


def sample(prompt, reward, n_completion=3, lp=-1.0):
    return Sample(prompt_index=prompt, prompt_token_ids=[5, 6], token_ids=[7] * n_completion,
                  logprobs=[lp] * n_completion, reward=reward, policy_version=0)


class FixedModels:
    """`LearnerModels` that return given tensors (or zeros like the microbatch, on its device)."""

    def __init__(self, reference=None, policy=None, values=None):
        self.given = {"reference": reference, "policy": policy, "values": values}

    def _out(self, which, mbs):
        return self.given[which] or [torch.zeros(mb["input_ids"].shape, device=mb["input_ids"].device) for mb in mbs]

    def reference_logprobs(self, mbs):
        return self._out("reference", mbs)

    def policy_logprobs(self, mbs):
        return self._out("policy", mbs)

    def values(self, mbs):
        return self._out("values", mbs)


def test_dpo_rows_are_adjacent_pairs_and_ties_are_skipped():
    samples = [sample(0, 1.0), sample(0, 0.0), sample(1, 0.0), sample(1, 0.0), sample(2, 0.0), sample(2, 1.0)]
    rows, stats = algo("online_dpo").select(samples, K)
    assert [r.reward for r in rows] == [1.0, 0.0, 1.0, 0.0]  # chosen, rejected, chosen, rejected
    assert [r.prompt_index for r in rows] == [0, 0, 2, 2]
    assert stats["dpo/tied_prompts"] == 1.0


def test_microbatches_have_one_shape_and_padding_weighs_nothing():
    rows = [sample(i, float(i % 2), n_completion=1 + i) for i in range(5)]
    mbs = algo("rloo", beta=0.0).microbatches(rows, pad_id=0, micro_batch_size=2)
    assert len(mbs) == 3 and {tuple(mb["input_ids"].shape) for mb in mbs} == {(2, 2 + 5)}
    assert mbs[-1]["row_weight"].tolist() == [1.0, 0.0]
    # mean over microbatches of loss_scale * (mean over the microbatch's real rows) = mean over rows
    assert sum(mb["loss_scale"].item() for mb in mbs) / len(mbs) == pytest.approx(1.0)
    assert [mb["loss_scale"].item() for mb in mbs] == pytest.approx([2 * 3 / 5, 2 * 3 / 5, 1 * 3 / 5])


def test_microbatch_size_is_evened_out_so_that_padding_is_less_than_a_unit_per_microbatch():
    rows = [sample(i, float(i % 2)) for i in range(9)]
    mbs = algo("rloo", beta=0.0).microbatches(rows, pad_id=0, micro_batch_size=4)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [3, 3, 3]  # not 3 x 4 with 3 padding rows
    assert sum(mb["row_weight"].sum().item() for mb in mbs) == 9
    pairs = [s for p in range(5) for s in (sample(p, 1.0), sample(p, 0.0))]
    dpo = algo("online_dpo")
    mbs = dpo.microbatches(dpo.select(pairs, K)[0], pad_id=0, micro_batch_size=8)  # 10 rows: 2 x 6, one padding pair
    assert [mb["input_ids"].shape[0] for mb in mbs] == [6, 6] and mbs[1]["row_weight"].tolist() == [1] * 4 + [0] * 2
    assert sum(mb["loss_scale"].item() for mb in mbs) / len(mbs) == pytest.approx(1.0)


def test_pairs_never_straddle_microbatches():
    samples = [s for p in range(3) for s in (sample(p, 1.0), sample(p, 0.0))]
    rows, _ = algo("online_dpo").select(samples, K)
    mbs = algo("online_dpo").microbatches(rows, pad_id=0, micro_batch_size=3)
    assert all(mb["input_ids"].shape[0] == 4 for mb in mbs)  # odd size rounded up to whole pairs
    assert mbs[1]["row_weight"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_dpo_loss_fn_equals_the_mean_over_real_pairs():
    samples = [s for p in range(3) for s in (sample(p, 1.0), sample(p, 0.0))]
    rows, _ = algo("online_dpo").select(samples, K)
    mbs = algo("online_dpo").microbatches(rows, pad_id=0, micro_batch_size=4)
    loss_fn = algo("online_dpo", beta=0.1).loss
    torch.manual_seed(0)
    logps, losses = [], []
    for mb in mbs:
        attach([mb], "ref_logprobs", [-torch.rand(mb["input_ids"].shape) * mb["loss_mask"]])
        lp = -torch.rand(mb["input_ids"].shape) * mb["loss_mask"]
        logps.append((lp, mb))
        losses.append(loss_fn(lp, mb)[0])
    got = torch.stack(losses).sum() / len(losses)  # what megatron's schedule computes
    seq = torch.cat([sequence_logprobs(lp, mb["loss_mask"])[mb["row_weight"] > 0] for lp, mb in logps])
    ref = torch.cat([sequence_logprobs(mb["ref_logprobs"], mb["loss_mask"])[mb["row_weight"] > 0] for _, mb in logps])
    want, _ = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=0.1)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_rloo_advantages_use_kl_regularised_rewards():
    rows = [sample(0, 1.0, lp=-1.0), sample(0, 0.0, lp=-1.0)]
    rloo = algo("rloo", beta=0.5)
    mbs = rloo.microbatches(rows, pad_id=0, micro_batch_size=4)
    policy = torch.tensor([[0, 0, -1.0, -1.0, -1.0], [0, 0, -2.0, -2.0, -2.0]])[:, :mbs[0]["loss_mask"].shape[1]]
    # KL of the learner's policy to the reference: row 0 3 tokens x 0.1, row 1 3 x 0.2
    reference = policy - torch.tensor([[0.1], [0.2]]) * mbs[0]["loss_mask"]
    stats = rloo.prepare([mbs], FixedModels(reference=[reference], policy=[policy]), K)
    r = [1.0 - 0.5 * 0.3, 0.0 - 0.5 * 0.6]
    assert mbs[0]["advantages"].tolist() == pytest.approx([r[0] - r[1], r[1] - r[0]])  # one group: no padding
    assert float(stats["rloo/kl"]) == pytest.approx(0.45)


@pytest.mark.parametrize("algorithm", ["rloo", "proximal_rloo", "ppo"])
def test_the_kl_in_the_reward_is_the_learners_not_the_generators(algorithm):
    """Before the first update the learner's policy is its reference, so the KL in the reward is 0,
    whatever vLLM's logprobs (another engine's numerics: bf16 SmolLM2 differed by ~0.03 a token)."""
    rows = [sample(0, 0.0, lp=-1.0), sample(0, 0.0, lp=-1.7)]  # a group of equal scores
    alg = algo(algorithm, beta=0.5)
    mbs = alg.microbatches(rows, pad_id=0, micro_batch_size=4)
    learner = [-torch.rand(mbs[0]["input_ids"].shape, generator=torch.Generator().manual_seed(0))]
    alg.prepare([mbs], FixedModels(reference=learner, policy=learner), K)
    if algorithm == "ppo":  # the KL-shaped per-token rewards are 0, so are the raw advantages over V_old = 0
        assert mbs[0]["returns"].abs().max().item() == 0
    else:
        assert mbs[0]["advantages"].abs().max().item() == 0


def with_padding_row(mb: Microbatch) -> Microbatch:
    """`mb` with one padding row appended as `Algorithm.microbatches` pads a short last microbatch:
    a copy of row 0 with row_weight 0, after the `real_rows` real ones."""
    padded = {k: torch.cat([v, v[:1] * (0 if k == "row_weight" else 1)]) if isinstance(v, torch.Tensor) and v.dim()
              else v for k, v in mb.items()}
    return cast(Microbatch, padded)  # the same keys as mb


def ppo_microbatch():
    """One group of K=2 (rewards 1 and 0) in a microbatch of 3 rows: row 2 is padding (a copy of row 0).

    Columns: 2 prompt tokens, then completion tokens (row 0: 2, row 1: 1). The learner's old - ref
    logprob is 0.5 on row 0's first completion token, 0 elsewhere; V_old is 9 off the completion mask
    (ignored).
    """
    ppo = algo("ppo", beta=0.2)
    rows, _ = ppo.select([sample(0, 1.0, n_completion=2, lp=-1.0), sample(0, 0.0, n_completion=1, lp=-0.5)], K)
    (mb,) = ppo.microbatches(rows, pad_id=0, micro_batch_size=3)  # 2 rows: `microbatches` pads none
    mb = with_padding_row(mb)
    attach([mb], "ref_logprobs", [torch.tensor([[0, 0, -1.5, -1.0], [0, 0, -0.5, 0], [0, 0, -1.5, -1.0]])])
    attach([mb], "old_logprobs", [torch.tensor([[0, 0, -1, -1], [0, 0, -0.5, 0], [0, 0, -1, -1.0]])])
    attach([mb], "old_values", [torch.tensor([[9, 9, 0.5, 0.8], [9, 9, 0.2, 9], [9, 9, 0.5, 0.8]])])
    return mb


def test_ppo_rewards_gae_and_whitening_match_hand_computation():
    mb = ppo_microbatch()
    metrics = ppo_algo(beta=0.2, gamma=0.9, lam=0.5).add_advantages([mb])
    # rewards: row 0 [-0.2 * 0.5, 0 + score 1] = [-0.1, 1.0]; row 1 [0 + score 0]
    # row 0: A3 = 1.0 - 0.8 = 0.2;  A2 = (-0.1 + 0.9 * 0.8 - 0.5) + 0.9 * 0.5 * 0.2 = 0.12 + 0.09 = 0.21
    # row 1: A2 = 0 - 0.2 = -0.2.   returns = A + V_old
    torch.testing.assert_close(mb["returns"][:2], torch.tensor([[0, 0, 0.71, 1.0], [0, 0, 0.0, 0]]))
    raw = [0.21, 0.2, -0.2]  # the padding row takes no part in the whitening
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3)
    white = [(a - mean) / std for a in raw]
    torch.testing.assert_close(mb["advantages"], torch.tensor([[0, 0, white[0], white[1]], [0, 0, white[2], 0], [0] * 4]))
    returns = [0.71, 1.0, 0.0]
    var_r = sum((r - sum(returns) / 3) ** 2 for r in returns) / 3
    assert float(metrics["ppo/explained_variance"]) == pytest.approx(1 - std ** 2 / var_r, rel=1e-5)  # R - V_old = raw A
    assert float(metrics["ppo/kl"]) == pytest.approx((0.5 + 0.0) / 2)
    assert float(metrics["ppo/return_mean"]) == pytest.approx(sum(returns) / 3)


def test_ppo_loss_fns_use_old_logprobs_values_and_real_rows_only():
    from megatron_async.algorithms.losses import ppo_policy_loss, ppo_value_loss

    mb = ppo_microbatch()
    ppo = ppo_algo(beta=0.2, gamma=0.9, lam=0.5, clip_eps=0.2, vf_coef=0.1)
    ppo.add_advantages([mb])
    new = mb["old_logprobs"] + 0.35 * mb["loss_mask"]  # ratio e^0.35: clipped where A > 0
    loss, m = ppo.loss(new, mb)
    want, _ = ppo_policy_loss(new[:2], mb["old_logprobs"][:2], mb["advantages"][:2], mb["loss_mask"][:2], 0.2)
    assert loss.item() == pytest.approx(want.item() * mb["loss_scale"].item())
    assert 0 < m["policy/clipfrac"].item() < 1
    values = mb["old_values"] + 0.5
    vloss, vm = ppo.value_loss(values, mb)
    vwant, _ = ppo_value_loss(values[:2], mb["old_values"][:2], mb["returns"][:2], mb["loss_mask"][:2], 0.2)
    assert vloss.item() == pytest.approx(0.1 * vwant.item() * mb["loss_scale"].item())
    assert set(vm) == {"loss/value", "value/clipfrac", "value/mean"}


def test_values_are_aligned_with_logprobs():
    from megatron_async.learner.logprobs import token_values

    head = torch.tensor([[[1.0], [2.0], [3.0]]])  # the head's output after positions 0, 1, 2
    assert token_values(head, torch.zeros(1, 3, dtype=torch.long)).tolist() == [[0.0, 1.0, 2.0]]


def test_best_of_k_keeps_only_exact_matches():
    rows, stats = algo("best_of_k_sft").select([sample(0, 0.0), sample(0, 1.0), sample(1, 0.0)], K)
    assert [r.reward for r in rows] == [1.0] and stats["sft/below_min_reward"] == 1.0
    assert not math.isnan(stats["sft/selected"])


def test_minibatches_and_dp_shards_keep_units_whole():
    rows = list(range(12))  # 3 RLOO groups of k=4
    parts = algorithms.split_units(rows, unit=4, n=2)
    assert parts == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7]]
    assert algorithms.split_units(rows, unit=4, n=8) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    shards = [algorithms.dp_shard(rows, 2, dp=2, dp_rank=r) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == rows and all(len(s) == 6 for s in shards)
    assert algorithms.dp_shard(rows, 4, dp=4, dp_rank=3) == rows  # 3 groups, 4 ranks: replicate
    assert algo("online_dpo").unit(4) == 2 and algo("rloo").unit(4) == 4 and algo("best_of_k_sft").unit(4) == 1
    assert algo("rloo").unit(6) == 6  # K is the batch's (trainer.auto_balance changes it), not the algorithm's


def test_dpo_nll_term_adds_the_chosen_token_mean_nll():
    samples = [sample(0, 1.0), sample(0, 0.0)]
    rows, _ = algo("online_dpo").select(samples, K)
    (mb,) = algo("online_dpo").microbatches(rows, pad_id=0, micro_batch_size=2)
    attach([mb], "ref_logprobs", [torch.zeros(mb["input_ids"].shape)])
    lp = -0.5 * mb["loss_mask"]  # every completion token has logprob -0.5
    plain, _ = algo("online_dpo", beta=0.1).loss(lp, mb)
    rpo, m = algo("online_dpo", beta=0.1, dpo_nll_coef=2.0).loss(lp, mb)
    assert m["loss/chosen_nll"].item() == pytest.approx(0.5)
    assert (rpo - plain).item() == pytest.approx(2.0 * 0.5)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_batch_preparation_and_loss_stay_on_the_learners_device(name):
    """Learner outputs on one device, the batch on another, must never meet.

    Microbatches go to the learner's device and the learner's outputs come back there; `meta`
    tensors (shapes only) stand in for a GPU: any CPU tensor in the arithmetic raises."""
    a = algo(name)
    samples = [sample(p, float(i), n_completion=2 + i) for p in range(3) for i in range(2)]
    rows, _ = a.select(samples, K)
    minibatches = [a.microbatches(part, pad_id=0, micro_batch_size=3, device="meta")
                   for part in algorithms.split_units(rows, a.unit(K), 2)]
    stats = a.prepare(minibatches, FixedModels(), K)
    assert all(v.device.type == "meta" for v in stats.values())
    mb = minibatches[0][0]
    loss, metrics = a.loss(torch.zeros(mb["input_ids"].shape, device="meta"), mb)
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())
    if a.value_loss is not None:
        assert a.value_loss(torch.zeros(mb["input_ids"].shape, device="meta"), mb)[0].device.type == "meta"


def test_config_allows_exactly_the_registered_algorithms():
    import typing

    from megatron_async.config import ConfigError, load_config

    hint = typing.get_type_hints(TrainerConfig)["algorithm"]
    assert set(typing.get_args(hint)) == set(ALGORITHMS)
    with pytest.raises(ConfigError, match="trainer.algorithm"):
        load_config(None, ["trainer.algorithm=reinforce"])


class CountingModels(FixedModels):
    """FixedModels that count the policy's forward passes (the staleness monitor's / pi_old's)."""

    def __init__(self, policy):
        super().__init__(policy=policy)
        self.policy_calls = 0

    def policy_logprobs(self, mbs):
        self.policy_calls += 1
        return super().policy_logprobs(mbs)


@pytest.mark.parametrize("name,minibatches,updates,fused", [
    ("online_dpo", 1, 1, True),  # only the monitor wants pi_old and the batch is one optimizer step
    ("online_dpo", 2, 1, False),  # the second minibatch trains on updated weights: a forward of its own
    ("online_dpo", 1, 2, False),  # so does the second pass
    ("rloo", 1, 1, False),  # tis (the async default correction) weighs the loss by pi_old
    ("grpo", 1, 1, False),  # the loss anchors to pi_old
])
def test_the_staleness_monitor_reads_the_training_forward_only_for_one_optimizer_step(name, minibatches, updates,
                                                                                        fused):
    a = ALGORITHMS[name](TrainerConfig(algorithm=name), "tis")
    samples = [sample(p, float(i), n_completion=2 + i, lp=-0.5 - p) for p in range(4) for i in range(2)]
    rows, _ = a.select(samples, K)
    parts = algorithms.split_units(rows, a.unit(K), minibatches)
    mbs = lambda: [a.microbatches(part, pad_id=0, micro_batch_size=4) for part in parts]  # noqa: E731
    old = [torch.full(mb["input_ids"].shape, -1.0) * mb["loss_mask"] for mb in mbs()[0]]
    assert a.monitor_from_training(mbs(), updates) == fused
    separate = CountingModels(old)
    stats_separate = a.prepare(mbs(), separate, K)
    assert separate.policy_calls == minibatches
    if fused:  # no forward of its own; the learner gives it the training forward's logprobs afterwards
        deferred, models = mbs(), CountingModels(old)
        assert a.prepare(deferred, models, K, old_from_training=True) == {} and models.policy_calls == 0
        attach(deferred[0], "old_logprobs", old)
        stats_deferred = a.staleness(deferred)
        assert stats_deferred.keys() == stats_separate.keys() and stats_deferred
        for key, value in stats_separate.items():
            assert stats_deferred[key].item() == pytest.approx(value.item()), key


# -- token-budget microbatches (trainer.micro_batch_tokens) ------------------------------------------
def varied(n_rows, pairs=False):
    """Rows of prompt 2 + completion 1..9 tokens, in no length order (DPO: adjacent chosen/rejected)."""
    lengths = [(7 * i) % 9 + 1 for i in range(n_rows)]
    return [sample(i // 2 if pairs else i, float((i + 1) % 2) if pairs else float(i % 3), n_completion=n)
            for i, n in enumerate(lengths)]


def test_token_budget_groups_hold_every_row_once_under_the_budget_and_the_row_cap():
    from megatron_async.algorithms.base import token_budget_groups

    rows = varied(13)
    length = [len(r.prompt_token_ids) + len(r.token_ids) for r in rows]
    groups = token_budget_groups(rows, per_unit=1, max_rows=4, max_tokens=24)
    assert sorted(i for g in groups for i in g) == list(range(13))
    for g in groups:
        assert len(g) <= 4 and (len(g) == 1 or len(g) * max(length[i] for i in g) <= 24), (g, [length[i] for i in g])
    assert [max(length[i] for i in g) for g in groups] == sorted((max(length[i] for i in g) for g in groups), reverse=True)
    pairs = token_budget_groups(varied(12, pairs=True), per_unit=2, max_rows=4, max_tokens=30)
    assert all(g[i] % 2 == 0 and g[i + 1] == g[i] + 1 for g in pairs for i in range(0, len(g), 2))  # pairs whole
    assert token_budget_groups(rows, 1, max_rows=8, max_tokens=5) == [[i] for i in sorted(range(13), key=lambda i: -length[i])]


def test_token_budget_microbatches_pad_each_to_its_own_longest_row_and_pad_less():
    rows = varied(13)
    rloo = algo("rloo", beta=0.0)
    by_rows = rloo.microbatches(rows, pad_id=0, micro_batch_size=4)
    by_tokens = rloo.microbatches(rows, pad_id=0, micro_batch_size=4, max_tokens=24)
    for mb in by_tokens:
        lengths = [len(rows[i].prompt_token_ids) + len(rows[i].token_ids) for i in mb["row_index"].tolist()]
        assert mb["input_ids"].shape == (len(lengths), max(lengths)) and mb["real_rows"] == len(lengths)
        assert mb["row_weight"].tolist() == [1.0] * len(lengths)
    assert sum(mb["loss_scale"].item() for mb in by_tokens) / len(by_tokens) == pytest.approx(1.0)
    assert sum(mb["input_ids"].numel() for mb in by_tokens) < sum(mb["input_ids"].numel() for mb in by_rows)


def test_on_gpu_a_microbatch_length_is_rounded_up_and_the_budget_counts_it():
    """learner.schedule.microbatch_seq_multiple: 64 on CUDA, 1 (exact lengths) on CPU. Rounded
    microbatches hold the same rows and real tokens, the extra columns padding off the loss mask;
    under a budget the rounded length is what rows x length <= budget counts."""
    from megatron_async.learner.schedule import GPU_SEQ_MULTIPLE, microbatch_seq_multiple

    assert microbatch_seq_multiple("cuda:1") == microbatch_seq_multiple(torch.device("cuda")) == GPU_SEQ_MULTIPLE == 64
    assert microbatch_seq_multiple("cpu") == 1
    rows = [sample(i, float(i % 3), n_completion=n) for i, n in enumerate([3, 70, 9, 120, 5, 64])]  # + 2 prompt tokens
    rloo = algo("rloo", beta=0.0)
    exact = rloo.microbatches(rows, pad_id=0, micro_batch_size=8, max_tokens=256)
    rounded = rloo.microbatches(rows, pad_id=0, micro_batch_size=8, max_tokens=256, seq_multiple=8)
    assert [mb["input_ids"].shape[1] for mb in exact] == [122, 66, 5]  # exact: each group's longest row
    for mb in rounded:
        b, s = mb["input_ids"].shape
        assert s % 8 == 0 and (b == 1 or b * s <= 256), (b, s)
        assert s - 8 < max(len(rows[i].prompt_token_ids) + len(rows[i].token_ids) for i in mb["row_index"].tolist())
    assert [mb["input_ids"].shape[1] for mb in rounded] == [128, 72, 8]
    assert sorted(i for mb in rounded for i in mb["row_index"].tolist()) == list(range(len(rows)))
    assert sum(mb["loss_mask"].sum().item() for mb in rounded) == sum(mb["loss_mask"].sum().item() for mb in exact)
    by_rows = rloo.microbatches(rows, pad_id=0, micro_batch_size=8, seq_multiple=GPU_SEQ_MULTIPLE)
    assert [mb["input_ids"].shape for mb in by_rows] == [(6, 128)]  # by rows too: 122 -> 128


@pytest.mark.parametrize("max_tokens", [24, 60])
def test_under_a_token_budget_the_dpo_loss_is_the_same_mean_over_pairs(max_tokens):
    dpo = algo("online_dpo", beta=0.1)
    rows = varied(12, pairs=True)
    torch.manual_seed(0)
    lp_of = {i: -torch.rand(12) for i in range(12)}  # per row, position-aligned logprobs
    ref_of = {i: -torch.rand(12) for i in range(12)}

    def schedule_loss(mbs, index_of):
        losses = []
        for mb in mbs:
            s, index = mb["input_ids"].shape[1], index_of(mb)
            attach([mb], "ref_logprobs", [torch.stack([ref_of[i][:s] for i in index]) * mb["loss_mask"]])
            lp = torch.stack([lp_of[i][:s] for i in index]) * mb["loss_mask"]
            losses.append(dpo.loss(lp, mb)[0])
        return sum(losses) / len(losses)  # what megatron's schedule computes

    by_rows = dpo.microbatches(rows, pad_id=0, micro_batch_size=4)
    by_tokens = dpo.microbatches(rows, pad_id=0, micro_batch_size=4, max_tokens=max_tokens)
    in_order = iter(range(12))
    want = schedule_loss(by_rows, lambda mb: [next(in_order) for _ in range(mb["input_ids"].shape[0])])
    got = schedule_loss(by_tokens, lambda mb: mb["row_index"].tolist())
    assert len(by_tokens) != len(by_rows) or max_tokens == 60
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_under_a_token_budget_per_row_values_come_back_in_row_order():
    from megatron_async.algorithms.base import real_rows_of, scatter_rows

    rows = [sample(i // K, float(i % 2), n_completion=1 + (5 * i) % 7) for i in range(8)]
    rloo = algo("rloo", beta=0.5)
    results = []
    for max_tokens in (0, 20):
        mbs = rloo.microbatches(rows, pad_id=0, micro_batch_size=3, max_tokens=max_tokens)
        assert real_rows_of(mbs, "rewards").tolist() == [r.reward for r in rows]
        rloo.prepare([mbs], FixedModels(reference=[mb["gen_logprobs"] - 0.1 * mb["loss_mask"] for mb in mbs]), K)
        results.append(real_rows_of(mbs, "advantages"))
        scatter_rows(mbs, "is_sequence_weights", torch.arange(8.0))  # a per-row field rloo does not read
        assert real_rows_of(mbs, "is_sequence_weights").tolist() == list(range(8))
    assert results[1].tolist() == pytest.approx(results[0].tolist())
