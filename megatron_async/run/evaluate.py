"""Held-out evaluation with greedy decoding through the vLLM replicas, scored by the run's reward.

The headline number is the mean reward of the greedy completions over the prompts that could be
scored, named by `reward.kind` (EVAL_METRIC): pass@1 for GSM8k exact match, the mean reward-model
score ("rm_score") for a reward model. Samples that could not be scored are counted ("errors",
"timeouts") and left out of the mean, never counted as 0. `greedy_eval` is what the trainer calls
before and after RL (on its own pool and scorer) and what `megatron-async eval` calls on any HF
checkpoint (run/eval_command.py), with a progress bar over chunks of prompts. `paired_test` compares
two exact-match evaluations of the same problems problem by problem (the run's summary, run/report.py,
and tools/compare_evals.py).

The JSON (`--output`; eval_<tag>.json in a run dir) holds the headline numbers and, per problem:
id, question, reference answer, completion, the number read from it ("extracted", exact match),
the reward, the verdict ("correct" / "wrong" for exact match, "scored" for a reward model,
"error" / "timeout" when it could not be scored), the error and the policy version.
"""
from __future__ import annotations

import math

from tqdm import tqdm

from megatron_async.rewards import extract_answer
from megatron_async.rollout.replica import Sampling

EVAL_METRIC = {"gsm8k_exact_match": "pass@1", "reward_model": "rm_score"}  # reward.kind -> name


EVAL_CHUNK = 64  # prompts in flight per replica per progress-bar tick (one request each; vLLM batches them)


def _verdict(reward_kind: str, score) -> str:
    if score.timed_out:
        return "timeout"
    if score.reward is None:
        return "error"
    if reward_kind == "gsm8k_exact_match":
        return "correct" if score.reward > 0 else "wrong"
    return "scored"


def greedy_eval(pool, tokenizer, prompts, scorer, reward_kind: str, max_new_tokens: int, stop=(),
                on_error: str = "drop", progress: bool = False, desc: str = "eval") -> dict:
    """Greedy completion of every prompt, scored by `scorer` (rewards.make_scorer).

    Returns {"metric": name, name: mean reward, "n", "scored", "errors", "timeouts", "results"};
    under on_error="stop" a sample that cannot be scored raises instead. `progress`: a tqdm bar
    over chunks of EVAL_CHUNK prompts per replica.
    """
    sampling = Sampling(n=1, temperature=0.0, max_tokens=max_new_tokens, stop=tuple(stop), logprobs=False)
    step = EVAL_CHUNK * max(1, len(pool.pids()))
    records = []
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, mininterval=5) as bar:
        for start in range(0, len(prompts), step):
            chunk = prompts[start:start + step]
            records += pool.generate([p.ids for p in chunk], sampling)
            bar.update(len(chunk))
    texts = [tokenizer.decode(rec.token_ids, skip_special_tokens=True) for rec in records]
    report = scorer.score(list(prompts), texts, [p.problem.answer for p in prompts], on_error)
    exact = reward_kind == "gsm8k_exact_match"
    results = [{"id": p.problem.id, "question": p.problem.question, "reference": p.problem.answer,
                "completion": text, "extracted": extract_answer(text) if exact else None, "reward": s.reward,
                "verdict": _verdict(reward_kind, s), "error": s.error, "policy_version": rec.policy_version}
               for p, text, rec, s in zip(prompts, texts, records, report.scores)]
    kept = [s.reward for s in report.kept()]
    metric = EVAL_METRIC[reward_kind]
    return {"metric": metric, metric: sum(kept) / len(kept) if kept else float("nan"), "n": len(results),
            "scored": len(kept), "errors": report.n_errors, "timeouts": report.n_timeouts, "results": results}


def paired_test(before: dict, after: dict) -> dict:
    """Two exact-match evaluations of the same problems (greedy_eval's results, e.g. a run's
    eval_before.json and eval_after.json), problem by problem: how many both got right, "up" (wrong
    -> right), "down" (right -> wrong), the paired difference in pass@1 with its standard error, and
    the exact two-sided McNemar p-value (the binomial test of up against down: under no change, each
    problem that changed is as likely to go either way). Problems either side could not score are
    left out of the pairing."""
    b = {r["id"]: r["reward"] for r in before["results"]}
    a = {r["id"]: r["reward"] for r in after["results"]}
    ids = [i for i in b if i in a and b[i] is not None and a[i] is not None]
    up = sum(1 for i in ids if b[i] < 1 <= a[i])
    down = sum(1 for i in ids if a[i] < 1 <= b[i])
    both = sum(1 for i in ids if b[i] >= 1 and a[i] >= 1)
    n, d = len(ids), up + down
    p_value = min(1.0, 2 * sum(math.comb(d, k) for k in range(min(up, down) + 1)) / 2 ** d) if d else 1.0
    diff = (up - down) / n if n else float("nan")
    se_diff = math.sqrt(max(0.0, d - (up - down) ** 2 / n)) / n if n else float("nan")
    return {"paired": n, "both_right": both, "up": up, "down": down, "difference": diff,
            "difference_se": se_diff, "mcnemar_p": p_value}
