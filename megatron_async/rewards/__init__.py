"""Rewards: GSM8k exact match, a reward-model worker process, and failure-aware scoring."""
from megatron_async.rewards.gsm8k import answers_match, extract_answer, gsm8k_reward, parse_number
from megatron_async.rewards.reward_model import RewardModelWorker
from megatron_async.rewards.scoring import SampleScore, ScoreReport, ScoringError, score_samples

__all__ = [
    "RewardModelWorker",
    "SampleScore",
    "ScoreReport",
    "ScoringError",
    "answers_match",
    "extract_answer",
    "gsm8k_reward",
    "parse_number",
    "score_samples",
]
