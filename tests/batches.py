"""Well-typed `RolloutBatch`es for tests that fake the rollout side: real `Problem`s and
`Sample`s (two tokens each), so a fake never hands the learner or the loop a field of the wrong type."""
from __future__ import annotations

from megatron_async.data.problem import Problem
from megatron_async.rollout.producer import RolloutBatch
from megatron_async.sample import Sample


def problems(n: int) -> list[Problem]:
    """`n` problems `1 + i = ?` with their answers."""
    return [Problem(id=f"test:{i}", question=f"1 + {i} = ?", solution=str(1 + i), answer=str(1 + i)) for i in range(n)]


def scored_batch(rewards: list[list[float | None]], index: int = 0, policy_version: int = 0) -> RolloutBatch:
    """Prompts x K completions with these rewards (K = the length of each row), sampled at `policy_version`."""
    samples = [Sample(prompt_index=i, prompt_token_ids=(1, 2), token_ids=(3, 4), logprobs=(-0.5, -0.25), reward=reward,
                      policy_version=policy_version, sample_index=j, replica_id=0, policy_version_max=policy_version)
               for i, row in enumerate(rewards) for j, reward in enumerate(row)]
    return RolloutBatch(index=index, policy_version=policy_version, problems=problems(len(rewards)), samples=samples)
