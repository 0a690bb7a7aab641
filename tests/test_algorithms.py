"""Per-algorithm row selection, microbatching and loss weighting (pure tensors, no engines)."""
import math

import pytest
import torch

from megatron_async import algorithms
from megatron_async.batching import Sample
from megatron_async.losses import dpo_loss, sequence_logprobs


def sample(prompt, reward, n_completion=3, lp=-1.0):
    return Sample(prompt_index=prompt, prompt_ids=[5, 6], completion_ids=[7] * n_completion,
                  logprobs=[lp] * n_completion, reward=reward, version=0)


def test_dpo_rows_are_adjacent_pairs_and_ties_are_skipped():
    samples = [sample(0, 1.0), sample(0, 0.0), sample(1, 0.0), sample(1, 0.0), sample(2, 0.0), sample(2, 1.0)]
    rows, stats = algorithms.select_samples("online_dpo", samples, k=2)
    assert [r.reward for r in rows] == [1.0, 0.0, 1.0, 0.0]  # chosen, rejected, chosen, rejected
    assert [r.prompt_index for r in rows] == [0, 0, 2, 2]
    assert stats["dpo/tied_prompts"] == 1.0


def test_microbatches_have_one_shape_and_padding_weighs_nothing():
    rows = [sample(i, float(i % 2), n_completion=1 + i) for i in range(5)]
    mbs = algorithms.build_microbatches("rloo", rows, pad_id=0, micro_batch_size=2, k=5, beta=0.0)
    assert len(mbs) == 3 and {tuple(mb["input_ids"].shape) for mb in mbs} == {(2, 2 + 5)}
    assert mbs[-1]["row_weight"].tolist() == [1.0, 0.0]
    # mean over microbatches of loss_scale * (mean over the microbatch's real rows) = mean over rows
    assert sum(mb["loss_scale"].item() for mb in mbs) / len(mbs) == pytest.approx(1.0)
    assert [mb["loss_scale"].item() for mb in mbs] == pytest.approx([2 * 3 / 5, 2 * 3 / 5, 1 * 3 / 5])


def test_pairs_never_straddle_microbatches():
    samples = [s for p in range(3) for s in (sample(p, 1.0), sample(p, 0.0))]
    rows, _ = algorithms.select_samples("online_dpo", samples, k=2)
    mbs = algorithms.build_microbatches("online_dpo", rows, pad_id=0, micro_batch_size=3, k=2, beta=0.1)
    assert all(mb["input_ids"].shape[0] == 4 for mb in mbs)  # odd size rounded up to whole pairs
    assert mbs[1]["row_weight"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_dpo_loss_fn_equals_the_mean_over_real_pairs():
    samples = [s for p in range(3) for s in (sample(p, 1.0), sample(p, 0.0))]
    rows, _ = algorithms.select_samples("online_dpo", samples, k=2)
    mbs = algorithms.build_microbatches("online_dpo", rows, pad_id=0, micro_batch_size=4, k=2, beta=0.1)
    loss_fn = algorithms.make_loss_fn("online_dpo", beta=0.1)
    torch.manual_seed(0)
    logps, losses = [], []
    for mb in mbs:
        mb["ref_logprobs"] = -torch.rand(mb["input_ids"].shape) * mb["loss_mask"]
        lp = -torch.rand(mb["input_ids"].shape) * mb["loss_mask"]
        logps.append((lp, mb))
        losses.append(loss_fn(lp, mb)[0])
    got = sum(losses) / len(losses)  # what megatron's schedule computes
    seq = torch.cat([sequence_logprobs(lp, mb["loss_mask"])[mb["row_weight"] > 0] for lp, mb in logps])
    ref = torch.cat([sequence_logprobs(mb["ref_logprobs"], mb["loss_mask"])[mb["row_weight"] > 0] for _, mb in logps])
    want, _ = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=0.1)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_rloo_advantages_use_kl_regularised_rewards():
    rows = [sample(0, 1.0, lp=-1.0), sample(0, 0.0, lp=-1.0)]
    mbs = algorithms.build_microbatches("rloo", rows, pad_id=0, micro_batch_size=4, k=2, beta=0.5)
    mbs[0]["ref_logprobs"] = mbs[0]["gen_logprobs"] - 0.1 * mbs[0]["loss_mask"]  # KL = 3 tokens x 0.1
    algorithms.add_rloo_advantages(mbs, k=2, beta=0.5)
    r = [1.0 - 0.5 * 0.3, 0.0 - 0.5 * 0.3]
    assert mbs[0]["advantages"].tolist() == pytest.approx([r[0] - r[1], r[1] - r[0], 0.0, 0.0])


def test_ppo_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="value model"):
        algorithms.make_loss_fn("ppo", beta=0.1)


def test_best_of_k_keeps_only_exact_matches():
    rows, stats = algorithms.select_samples("best_of_k_sft", [sample(0, 0.0), sample(0, 1.0), sample(1, 0.0)], k=2)
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
    assert algorithms.row_unit("online_dpo", 4) == 2 and algorithms.row_unit("rloo", 4) == 4


def test_dpo_nll_term_adds_the_chosen_token_mean_nll():
    samples = [sample(0, 1.0), sample(0, 0.0)]
    rows, _ = algorithms.select_samples("online_dpo", samples, k=2)
    (mb,) = algorithms.build_microbatches("online_dpo", rows, pad_id=0, micro_batch_size=2, k=2, beta=0.1)
    mb["ref_logprobs"] = torch.zeros(mb["input_ids"].shape)
    lp = -0.5 * mb["loss_mask"]  # every completion token has logprob -0.5
    plain, _ = algorithms.make_loss_fn("online_dpo", beta=0.1)(lp, mb)
    rpo, m = algorithms.make_loss_fn("online_dpo", beta=0.1, dpo_nll_coef=2.0)(lp, mb)
    assert m["loss/chosen_nll"].item() == pytest.approx(0.5)
    assert (rpo - plain).item() == pytest.approx(2.0 * 0.5)
