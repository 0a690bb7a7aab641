"""Rewards: GSM8k exact match (`gsm8k`), a reward-model worker process (`reward_model`),
failure-aware scoring (`scoring`), and `make_scorer`, which picks the run's reward from
`reward.kind` (`scorer`)."""
from megatron_async.rewards.gsm8k import answers_match, extract_answer, gsm8k_reward, parse_number
from megatron_async.rewards.reward_model import RewardModelWorker
from megatron_async.rewards.scorer import ExactMatchScorer, Scorer, make_scorer
from megatron_async.rewards.scoring import SampleScore, ScoreReport, ScoringError, score_samples

__all__ = [
    "ExactMatchScorer",
    "RewardModelWorker",
    "SampleScore",
    "ScoreReport",
    "Scorer",
    "ScoringError",
    "answers_match",
    "extract_answer",
    "gsm8k_reward",
    "make_scorer",
    "parse_number",
    "score_samples",
]
