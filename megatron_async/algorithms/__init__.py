"""The RL algorithms, one object each, and the registry the config's `trainer.algorithm` names.

    algo = build_algorithm(cfg)                            # e.g. OnlineDPO
    rows, stats = algo.select(samples, k); ...; algo.loss  # protocol in base.py

| name          | module            | trains on                               | loss                       |
|---------------|-------------------|-----------------------------------------|----------------------------|
| online_dpo    | online_dpo.py     | best vs worst of K per prompt           | DPO / IPO (+ RPO NLL)      |
| rloo          | rloo.py           | complete groups of K                    | REINFORCE, leave-one-out   |
| proximal_rloo | proximal_rloo.py  | complete groups of K                    | clipped IS ratio vs vLLM   |
| ppo           | ppo.py            | groups of K (for aligned shards)        | clipped surrogate + value  |
| grpo          | grpo.py           | groups of K whose rewards do not all tie| group-normalised, clipped  |
| best_of_k_sft | best_of_k_sft.py  | the best of K if it is an exact match   | NLL                        |

The loss arithmetic is in `losses/` (pure tensor functions), padding and selection helpers in
`batching.py`, importance corrections against the generator and the staleness statistics in
`off_policy.py`. Adding an algorithm: one module with an `Algorithm` subclass, one line below.
"""
from __future__ import annotations


from megatron_async.algorithms.base import Algorithm, LearnerModels, dp_shard, split_units
from megatron_async.algorithms.best_of_k_sft import BestOfKSFT
from megatron_async.algorithms.grpo import GRPO
from megatron_async.algorithms.online_dpo import OnlineDPO
from megatron_async.algorithms.ppo import PPO
from megatron_async.algorithms.proximal_rloo import ProximalRLOO
from megatron_async.algorithms.off_policy import resolve_correction
from megatron_async.algorithms.rloo import RLOO


ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (OnlineDPO, RLOO, ProximalRLOO, PPO, GRPO, BestOfKSFT)}


def build_algorithm(cfg) -> Algorithm:
    """The algorithm `trainer.algorithm` names, with the run's off-policy correction."""
    return ALGORITHMS[cfg.trainer.algorithm](cfg.trainer, resolve_correction(cfg))


__all__ = ["ALGORITHMS", "Algorithm", "LearnerModels", "build_algorithm", "dp_shard", "split_units"]
