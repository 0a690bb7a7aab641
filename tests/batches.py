"""Well-typed `RolloutBatch`es for tests that fake the rollout side: real `Problem`s and
`Completion`s (two tokens each), so a fake never hands the learner or the loop a field of the wrong type."""
from __future__ import annotations

from megatron_async.data.problem import Problem
from megatron_async.rollout.pool import Completion
from megatron_async.rollout.producer import RolloutBatch


def problems(n: int) -> list[Problem]:
    """`n` problems `1 + i = ?` with their answers."""
    return [Problem(id=f"test:{i}", question=f"1 + {i} = ?", solution=str(1 + i), answer=str(1 + i)) for i in range(n)]


def scored_batch(rewards: list[list[float | None]], index: int = 0, policy_version: int = 0) -> RolloutBatch:
    """Prompts x K completions with these rewards (K = the length of each row), sampled at `policy_version`."""
    completions = [[Completion(prompt_index=i, sample_index=j, prompt_token_ids=(1, 2), token_ids=(3, 4),
                               logprobs=(-0.5, -0.25), finish_reason="stop", replica_id=0,
                               policy_version=policy_version, policy_version_max=policy_version)
                    for j in range(len(row))] for i, row in enumerate(rewards)]
    return RolloutBatch(index=index, policy_version=policy_version, problems=problems(len(rewards)),
                        completions=completions, rewards=[list(row) for row in rewards])
