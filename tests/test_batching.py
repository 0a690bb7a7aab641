"""DPO pairing (ties skipped and counted), RLOO grouping, best-of-K selection and padding."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.algorithms.batching import (
    build_dpo_pairs,
    collate,
    group_samples,
    select_best_of_k,
)
from megatron_async.algorithms.losses import sequence_logprobs
from megatron_async.sample import Sample


def make(prompt_index, reward, completion=(7, 8), prompt=(1, 2, 3), version=0):
    logprobs = [-0.1 * (i + 1) - prompt_index for i in range(len(completion))]
    return Sample(prompt_index, list(prompt), list(completion), logprobs, reward, version)


def test_dpo_pairs_best_vs_worst_ties_skipped_and_counted():
    samples = [make(0, 0.0), make(0, 1.0), make(1, 1.0), make(0, 0.0), make(0, 1.0)]
    samples += [make(1, 1.0), make(2, 0.5)]  # prompt 1: all tied; prompt 2: one sample only
    samples += [make(3, 0.2), make(3, 0.9), make(3, -0.3)]
    pairs, stats = build_dpo_pairs(samples)
    assert [(c.prompt_index, c.reward, r.reward) for c, r in pairs] == [(0, 1.0, 0.0), (3, 0.9, -0.3)]
    assert pairs[0][0] is samples[1] and pairs[0][1] is samples[0]  # first of equals, deterministic
    assert stats["dpo/pairs"] == 2 and stats["dpo/tied_prompts"] == 1 and stats["dpo/too_few_samples"] == 1
    assert stats["dpo/reward_gap"] == pytest.approx((1.0 + 1.2) / 2)


@settings(deadline=None, max_examples=50)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=2, max_size=6), min_size=1, max_size=8))
def test_dpo_pairs_property(groups):
    samples = [make(p, r) for p, rewards in enumerate(groups) for r in rewards]
    pairs, stats = build_dpo_pairs(samples)
    untied = [p for p, rewards in enumerate(groups) if len(set(rewards)) > 1]
    assert [c.prompt_index for c, _ in pairs] == untied
    for c, r in pairs:
        assert c.reward == max(groups[c.prompt_index]) and r.reward == min(groups[c.prompt_index])
    assert stats["dpo/tied_prompts"] == len(groups) - len(untied)


@pytest.mark.parametrize("bad", [None, float("nan")])
def test_failed_rewards_are_rejected_not_zeroed(bad):
    with pytest.raises(ValueError, match="drop failed samples"):
        build_dpo_pairs([make(0, 1.0), make(0, bad)])


def test_group_samples_contiguous_complete_groups():
    samples = [make(0, 1.0), make(1, 0.0), make(0, 0.0), make(2, 1.0), make(1, 1.0), make(2, 1.0)]
    samples.append(make(3, 0.0))  # only one of k=2: a sibling was dropped
    grouped, stats = group_samples(samples, k=2)
    assert [s.prompt_index for s in grouped] == [0, 0, 1, 1, 2, 2]
    assert stats == {"group/incomplete_prompts": 1.0, "group/zero_variance_prompts": 1.0}
    with pytest.raises(ValueError, match="prompt 0 has 3 samples, more than k=2"):
        group_samples(samples + [make(0, 1.0)], k=2)


def test_select_best_of_k():
    samples = [make(0, 0.0), make(0, 1.0), make(1, 0.0), make(1, 0.0), make(2, 0.3), make(2, 0.7)]
    best, stats = select_best_of_k(samples)
    assert [(s.prompt_index, s.reward) for s in best] == [(0, 1.0), (1, 0.0), (2, 0.7)]
    assert best[1] is samples[2] and stats["sft/tied_prompts"] == 1
    best, stats = select_best_of_k(samples, min_reward=0.5)
    assert [s.prompt_index for s in best] == [0, 2] and stats["sft/below_min_reward"] == 1


def test_collate_layout_and_alignment():
    a = Sample(0, [11, 12], [21, 22, 23], [-1.0, -2.0, -3.0], 1.0, 5)
    b = Sample(1, [13, 14, 15], [24], [-4.0], 0.0, 6)
    batch = collate([a, b], pad_id=0)
    # right padding: a row's pads follow all its real tokens, so under the learner's causal attention
    # (the only mask it passes) no real token sees one, and no loss reads one (off the completion mask)
    assert batch.input_ids.tolist() == [[11, 12, 21, 22, 23], [13, 14, 15, 24, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]]
    assert batch.gen_logprobs is not None
    assert batch.gen_logprobs.tolist() == [[0, 0, -1.0, -2.0, -3.0], [0, 0, 0, -4.0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    # the mask picks out exactly each completion's tokens, and the losses' sums agree
    for row, s in zip(range(2), (a, b)):
        assert batch.input_ids[row][batch.completion_mask[row].bool()].tolist() == s.token_ids
    assert sequence_logprobs(batch.gen_logprobs, batch.completion_mask).tolist() == [-6.0, -4.0]
    assert collate([a, b], pad_id=0, pad_to_multiple_of=4).input_ids.shape == (2, 8)


def test_collate_errors_name_the_sample():
    with pytest.raises(ValueError, match="prompt 2: 1 logprobs for 2 completion tokens"):
        collate([Sample(2, [1], [3, 4], [-1.0], 1.0, 0)], pad_id=0)
    with pytest.raises(ValueError, match="some samples have generating logprobs"):
        collate([Sample(0, [1], [3], [-1.0], 1.0, 0), Sample(1, [1], [3], None, 1.0, 0)], pad_id=0)
    with pytest.raises(ValueError, match="empty prompt or completion"):
        collate([Sample(0, [1], [], [], 1.0, 0)], pad_id=0)
    assert collate([Sample(0, [1], [3], None, 1.0, 0)], pad_id=0).gen_logprobs is None


def test_dpo_pairs_collate_to_adjacent_rows():
    # OnlineDPO.select lays pairs out [c0, r0, c1, r1, ...] (a microbatch never splits a pair),
    # and its loss reads chosen from rows 0::2, rejected from rows 1::2
    from megatron_async.algorithms.online_dpo import OnlineDPO

    rows, _ = OnlineDPO(cfg=None).select([make(0, 0.0, (5,)), make(0, 1.0, (6, 7, 8)), make(1, 1.0, (9,)), make(1, 0.0, (4,))], 2)
    batch = collate(rows, pad_id=0)
    assert batch.gen_logprobs is not None
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.input_ids[:, 3].tolist() == [6, 5, 9, 4]
    logps = sequence_logprobs(batch.gen_logprobs, batch.completion_mask)
    assert logps[0::2].tolist() == pytest.approx([-0.1 - 0.2 - 0.3, -1.1])
    assert logps[1::2].tolist() == pytest.approx([-0.1, -1.1])
