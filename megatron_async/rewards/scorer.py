"""The run's reward, chosen in one place: `make_scorer(cfg.reward)`.

Both scorers share one interface, what the trainer's producer thread (training batches) and the
evaluation (held-out prompts) call:

    scorer = make_scorer(cfg.reward)     # a reward model's worker process is started here
    report = scorer.score(prompts, completion_texts, reference_answers, on_error)

`prompts` are strings or `data.TokenizedPrompt`s (`.text`, and `.messages` for a chat prompt: a
reward model renders the conversation with its own chat template, reward_model.py).
    scorer.close()

- `gsm8k_exact_match`: `gsm8k_reward` in threads with a per-sample timeout (scoring.score_samples);
  needs the reference answers.
- `reward_model`: a `RewardModelWorker` process; references are not used (a prompt may have none).
Either way a sample that could not be scored is counted in the `ScoreReport` and dropped or stops
the run (`reward.on_error`), never given reward 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from megatron_async.config import ConfigError
from megatron_async.rewards.gsm8k import gsm8k_reward
from megatron_async.rewards.reward_model import RewardModelWorker
from megatron_async.rewards.scoring import ScoreReport, score_samples

if TYPE_CHECKING:
    from megatron_async.config import RewardConfig


class Scorer(Protocol):
    def score(self, prompts: Sequence, completions: Sequence[str], references: Sequence[str | None],
              on_error: str = "drop") -> ScoreReport: ...

    def close(self) -> None: ...


@dataclass
class ExactMatchScorer:
    """GSM8k exact match of each completion's final number against its reference answer."""

    timeout_s: float = 5.0

    def score(self, prompts: Sequence, completions: Sequence[str], references: Sequence[str | None],
              on_error: str = "drop") -> ScoreReport:
        texts = [p if isinstance(p, str) else p.text for p in prompts]
        samples = list(zip(texts, completions, references, strict=True))
        return score_samples(samples, gsm8k_reward, timeout_s=self.timeout_s, on_error=on_error)

    def close(self) -> None:
        """Nothing to release: scoring runs in the caller's threads."""


def make_scorer(cfg: RewardConfig) -> Scorer:
    """The scorer `reward.kind` names, ready to score (a reward model is loaded before this returns)."""
    if cfg.kind == "reward_model":
        if cfg.device != "cpu":
            n = torch.cuda.device_count()  # 0 without CUDA
            if int(cfg.device.split(":")[1]) >= n:
                raise ConfigError(f"key 'reward.device' = {cfg.device!r}: " + (
                    f"only {n} CUDA device(s) here" if n else "no CUDA device here; use \"cpu\""))
        rm = RewardModelWorker(cfg.model_path, batch_size=cfg.batch_size, max_length=cfg.max_length,
                               dtype=cfg.dtype, timeout_s=cfg.timeout_s, device=cfg.device)
        rm.start()
        return rm
    return ExactMatchScorer(timeout_s=cfg.timeout_s)
