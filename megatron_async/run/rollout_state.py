"""Learner rank 0's rollout side: prompts, the replica pool, the reward scorer, the producer thread,
held-out evaluation, and the two controllers that tune generation between steps (rollout.max_lag:
auto, `run/adaptive_lag.py`; trainer.auto_balance, `run/auto_balance.py`).

    rollout = RolloutState.build(cfg, plan, tokenizer, init_model)    # loads prompts, starts scorer + replicas
    rollout.load_state_dict(state)         # on resume, before the producer starts
    rollout.start_producer(first_batch)
    batch = rollout.make_batch(index)      # (producer thread) take prompts, generate, score
    rollout.after_step(step, batch, metrics)   # the batch trained: data position, lag, T and K
    rollout.evaluate("before", version, tracker)

`state_dict()` is everything a resume needs from this side (the run checkpoint saves it,
`run/checkpoint.py`): the generated, untrained batches, the prompt position after the last of them,
and the controllers' state. The per-step metrics and the end-of-run report are `run/report.py`'s.

Only global rank 0 holds one; the other ranks learn the replicas' addresses from it (`Trainer`).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_async.config import Config
from megatron_async.data import PromptIterator, TokenizedPrompt, load_prompts, load_train_prompts
from megatron_async.io_utils import atomic_write_text
from megatron_async.observability.tracking import Tracker
from megatron_async.rewards import Scorer, make_scorer
from megatron_async.rollout.build import start_pool
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.producer import RolloutBatch, RolloutProducer, batch_from_json, batch_to_json
from megatron_async.rollout.replica import Sampling
from megatron_async.run import faults
from megatron_async.run.adaptive_lag import AdaptiveLag
from megatron_async.run.auto_balance import AutoBalance
from megatron_async.run.evaluate import greedy_eval
from megatron_async.run_plan import RunPlan

log = logging.getLogger(__name__)


@dataclass
class RolloutState:
    cfg: Config
    tokenizer: Any  # the policy's HF tokenizer (transformers types `decode` too narrowly for token tuples)
    prompts: PromptIterator  # training prompts, resumable
    eval_prompts: list[TokenizedPrompt]
    scorer: Scorer
    pool: ReplicaPool
    data_state: dict  # prompt position after the last trained batch
    producer: RolloutProducer | None = None  # started by `start_producer`
    adaptive_lag: AdaptiveLag | None = None  # rollout.max_lag: auto (run/adaptive_lag.py); None for a fixed lag
    balance: AutoBalance | None = None  # trainer.auto_balance (run/auto_balance.py); None: T and K fixed
    # this process's producer's idle seconds at the previous step (balance's per-step wait); not
    # resume state: a resumed run's producer starts at 0
    replica_idle_before: float = 0.0
    resumed_buffer: list[RolloutBatch] = field(default_factory=list)  # generated, untrained batches of a checkpoint

    @property
    def running(self) -> RolloutProducer:
        """The producer, once `start_producer` started it (before that: a RuntimeError)."""
        if self.producer is None:
            raise RuntimeError("the rollout producer is not started yet (RolloutState.start_producer)")
        return self.producer

    @classmethod
    def build(cls, cfg: Config, plan: RunPlan, tokenizer, init_model: Path) -> "RolloutState":
        d = cfg.data
        train, dropped = load_train_prompts(cfg, tokenizer)
        eval_prompts, _ = load_prompts(cfg, tokenizer, d.eval, "test", d.eval_size)
        if dropped:
            log.warning("dropped %d training prompts over data.max_prompt_tokens=%d", dropped, d.max_prompt_tokens)
        prompts = PromptIterator(train, seed=cfg.run.seed)
        scorer = make_scorer(cfg.reward)  # a reward model's worker process starts here
        try:
            pool = start_pool(cfg, plan, init_model)  # stops the replicas it started if one fails to come up
        except BaseException:
            scorer.close()
            raise
        log.info("replicas: %s (pids %s), %s (%s)", ", ".join(pool.urls), pool.pids(), plan.model_dtype, plan.model_dtype_why)
        adaptive_lag, balance = build_controllers(cfg)
        return cls(cfg, tokenizer, prompts, eval_prompts, scorer, pool, data_state=prompts.state_dict(),
                   adaptive_lag=adaptive_lag, balance=balance)

    def state_dict(self) -> dict:
        """JSON-able: the generated, untrained batches; the prompt position after the last of them
        (after the last trained batch if none: the prompts of a batch still being generated are
        taken again on resume, by the same version with the same seeds); the controllers' state
        (None where off). Call between learner steps, once the producer runs."""
        buffered = self.running.buffered()
        return {"buffer": [batch_to_json(b) for b in buffered],
                "data_state": buffered[-1].data_state if buffered else self.data_state,
                "adaptive_lag": None if self.adaptive_lag is None else self.adaptive_lag.state_dict(),
                "balance": None if self.balance is None else self.balance.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's `state_dict()`, before `start_producer`. A controller the config turns on
        resumes where the checkpoint left it; one the checkpointed run had off starts from the config."""
        self.data_state, self.resumed_buffer = state["data_state"], [batch_from_json(b) for b in state["buffer"]]
        self.prompts.load_state_dict(self.data_state)
        if self.adaptive_lag is not None and state["adaptive_lag"] is not None:
            self.adaptive_lag.load_state_dict(state["adaptive_lag"])
        if self.balance is not None and state["balance"] is not None:
            self.balance.load_state_dict(state["balance"])

    def start_producer(self, first_batch: int) -> RolloutProducer:
        lag = self.cfg.rollout.max_lag if self.adaptive_lag is None else self.adaptive_lag.lag
        if isinstance(lag, str):  # "auto" always has its controller (build_controllers)
            raise RuntimeError("rollout.max_lag: auto without its AdaptiveLag")
        self.producer = RolloutProducer(self.make_batch, lag, last_batch=self.cfg.trainer.steps - 1,
                                        first_batch=first_batch, synced_version=first_batch,
                                        ready=self.resumed_buffer,
                                        updates_during_generation=self.cfg.rollout.weight_update == "during_generation").start()
        return self.producer

    # -- the producer thread's work ----------------------------------------------------------------
    def make_batch(self, index: int) -> RolloutBatch:
        """Take the next prompts, generate K completions of each through the pool, score them."""
        r = self.cfg.rollout
        k = self.k()
        prompts = self.prompts.take(r.prompts_per_step)
        data_state = self.prompts.state_dict()
        sampling = Sampling(n=k, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
                            stop=tuple(r.stop), seed=self.cfg.run.seed * 1_000_003 + index * 10_007)
        t0 = time.monotonic()
        faults.kill_replica_during(index, self.pool.pids()[0])
        records = self.pool.generate([p.ids for p in prompts], sampling)
        gen_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in records]
        report = self.scorer.score([prompts[s.prompt_index] for s in records], texts,
                                   [prompts[s.prompt_index].problem.answer for s in records], self.cfg.reward.on_error)
        # a score's reward is None where scoring failed (kept under reward.on_error=drop, never a 0)
        samples = [replace(s, reward=score.reward) for s, score in zip(records, report.scores, strict=True)]
        return RolloutBatch(index=index, policy_version=min(s.policy_version for s in records), problems=[p.problem for p in prompts],
                            samples=samples, reward_errors=report.n_errors,
                            reward_timeouts=report.n_timeouts, gen_seconds=gen_seconds,
                            score_seconds=time.monotonic() - t0, data_state=data_state)

    # -- evaluation, the controllers --------------------------------------------------------------
    def evaluate(self, tag: str, version: int, tracker: Tracker) -> float | None:
        """The run's reward on greedy completions of the held-out prompts (run/evaluate.py: pass@1
        for exact match, the mean RM score for a reward model); None without held-out prompts."""
        if not self.eval_prompts:
            return None
        r = self.cfg.rollout
        result = greedy_eval(self.pool, self.tokenizer, self.eval_prompts, self.scorer, self.cfg.reward.kind,
                             r.max_new_tokens, r.stop, self.cfg.reward.on_error, progress=True, desc=f"eval {tag}")
        path = atomic_write_text(self.cfg.run_dir / f"eval_{tag}.json", json.dumps(result, indent=1))
        metric = result["metric"]
        name = "eval/" + metric.replace("@", "_at_")  # eval/pass_at_1 or eval/rm_score
        metrics = {name: result[metric], "eval/reward_errors": float(result["errors"]),
                   "eval/reward_timeouts": float(result["timeouts"])}  # the curve, by policy version
        if tag in ("before", "after"):
            metrics[f"{name}_{tag}"] = result[metric]
        tracker.log_metrics(metrics, step=version)
        tracker.log_artifact(path)
        log.info("%s (%s) = %.3f on %d of %d problems", metric, tag, result[metric], result["scored"], result["n"])
        return result[metric]

    def step_metrics(self) -> dict[str, float]:
        """The rollout side's metrics of the step just trained, before `after_step` moves the controllers:
        the pool's counters, the replicas' wait, and the lag and T in force (K: the batch's, `run/report.py`)."""
        pool = self.pool.stats()
        return {"rollout/requeued_requests": float(pool["requeues"]),
                "rollout/replica_restarts": float(pool["restarts"]),
                "rollout/replica_idle_s": self.running.idle_seconds,
                "rollout/max_lag": float(self.running.max_lag),
                "balance/updates_per_batch": float(self.updates_per_batch())}

    def after_step(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """Learner step `step` trained `batch` (its `metrics`): the data position moves past it and
        the controllers update from the step's measurements."""
        self.data_state = batch.data_state
        self._adapt_lag(step, metrics)
        self._rebalance(step, metrics)

    def k(self) -> int:
        """Completions per prompt for the batches generated from now on."""
        return self.cfg.rollout.k if self.balance is None else self.balance.k

    def updates_per_batch(self) -> int:
        """T: the learner's passes over its next batch."""
        return self.cfg.trainer.updates_per_batch if self.balance is None else self.balance.updates

    def _rebalance(self, step: int, metrics: dict[str, float]) -> None:
        """trainer.auto_balance: raise T or K by this step's waits of learner and replicas."""
        replica_wait = self.running.idle_seconds - self.replica_idle_before
        self.replica_idle_before = self.running.idle_seconds
        if self.balance is not None and self.balance.update(metrics["timing/learner_idle_s"], replica_wait,
                                                            metrics["timing/step_wall_s"]):
            log.info("step %d: %s", step, self.balance.reason)

    def _adapt_lag(self, step: int, metrics: dict[str, float]) -> None:
        """rollout.max_lag: auto: move the lag by this step's staleness and learner wait."""
        if self.adaptive_lag is None or "staleness/kl_k3_mean" not in metrics:
            return  # a fixed lag, or no trained tokens this step: nothing measured
        before = self.adaptive_lag.lag
        if self.adaptive_lag.update(metrics["staleness/kl_k3_mean"], metrics["timing/learner_idle_s"],
                                    metrics["timing/step_wall_s"]):
            log.info("step %d: rollout lag %d -> %d: %s", step, before, self.adaptive_lag.lag, self.adaptive_lag.reason)
            self.running.set_max_lag(self.adaptive_lag.lag)

    def close(self) -> None:
        """Stop the producer, the replicas and the scorer. The replicas stop before the producer is
        waited for: a generation under way (say one waiting for a replica's restart, the replicas
        having ended on a signal sent to every process of the job) ends at once, not at its timeout."""
        if self.producer is not None:
            self.producer.request_stop()
        self.pool.stop()
        if self.producer is not None:
            self.producer.stop()
        self.scorer.close()


def build_controllers(cfg: Config) -> tuple[AdaptiveLag | None, AutoBalance | None]:
    """The controllers the config turns on, in their starting state: rollout.max_lag: auto's lag
    and trainer.auto_balance's T and K (None where off)."""
    r, t = cfg.rollout, cfg.trainer
    adaptive_lag = AdaptiveLag(r.lag_kl_target, r.lag_cap) if r.max_lag == "auto" else None
    balance = AutoBalance(t.updates_per_batch, r.k, t.max_updates_per_batch, r.max_k) if t.auto_balance else None
    return adaptive_lag, balance
