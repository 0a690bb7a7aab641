"""Learner rank 0's rollout side: prompts, the replica pool, the reward scorer, the producer thread,
held-out evaluation and the run's metric history.

    rollout = RolloutState.build(cfg, tokenizer, init_model)    # loads prompts, starts scorer + replicas
    rollout.start_producer(first_batch)
    batch = rollout.make_batch(index)      # (producer thread) take prompts, generate, score
    rollout.evaluate("before", version, tracker)

Only global rank 0 holds one; the other ranks learn the replicas' addresses from it (`Trainer`).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from megatron_async.config import Config
from megatron_async.data import PromptIterator, TokenizedPrompt, load_prompts, load_train_prompts
from megatron_async.io_utils import atomic_write_text
from megatron_async.observability.logs import log_file
from megatron_async.observability.plots import plot_training
from megatron_async.observability.tracking import MlflowTracker, NullTracker
from megatron_async.rewards import Scorer, make_scorer
from megatron_async.rollout.build import start_pool
from megatron_async.rollout.pool import ReplicaPool
from megatron_async.rollout.producer import RolloutBatch, RolloutProducer
from megatron_async.rollout.replica import Sampling
from megatron_async.run import faults
from megatron_async.run.adaptive_lag import START_LAG, AdaptiveLag
from megatron_async.run.auto_balance import AutoBalance
from megatron_async.run.evaluate import EVAL_METRIC, greedy_eval

log = logging.getLogger(__name__)

@dataclass
class RolloutState:
    cfg: Config
    tokenizer: object  # the policy's HF tokenizer
    prompts: PromptIterator  # training prompts, resumable
    eval_prompts: list[TokenizedPrompt]
    scorer: Scorer
    pool: ReplicaPool
    data_state: dict  # prompt position after the last trained batch
    producer: RolloutProducer | None = None  # started by `start_producer`
    adaptive_lag: AdaptiveLag | None = None  # rollout.max_lag: auto (run/adaptive_lag.py); None for a fixed lag
    balance: AutoBalance | None = None  # trainer.auto_balance (run/auto_balance.py); None: T and K fixed
    replica_idle_before: float = 0.0  # the producer's idle seconds at the previous step (balance's per-step wait)
    history: list[dict] = field(default_factory=list)  # per-step metrics, for plots and `bench`
    resumed_buffer: list[RolloutBatch] = field(default_factory=list)  # generated, untrained batches of a checkpoint

    @classmethod
    def build(cls, cfg: Config, tokenizer, init_model: Path) -> "RolloutState":
        d = cfg.data
        train, dropped = load_train_prompts(cfg, tokenizer)
        eval_prompts, _ = load_prompts(cfg, tokenizer, d.eval, "test", d.eval_size)
        if dropped:
            log.warning("dropped %d training prompts over data.max_prompt_tokens=%d", dropped, d.max_prompt_tokens)
        prompts = PromptIterator(train, seed=cfg.run.seed)
        scorer = make_scorer(cfg.reward)  # a reward model's worker process starts here
        pool = start_pool(cfg, init_model)
        log.info("replicas: %s (pids %s)", ", ".join(pool.urls), pool.pids())
        adaptive = AdaptiveLag(cfg.rollout.lag_kl_target, cfg.rollout.lag_cap) if cfg.rollout.max_lag == "auto" else None
        return cls(cfg, tokenizer, prompts, eval_prompts, scorer, pool, data_state=prompts.state_dict(),
                   adaptive_lag=adaptive, balance=AutoBalance(cfg.trainer.updates_per_batch, cfg.rollout.k,
                                                              cfg.trainer.max_updates_per_batch, cfg.rollout.max_k)
                   if cfg.trainer.auto_balance else None)

    def restore(self, state: dict) -> None:
        """Rollout state of a run checkpoint (`run/checkpoint.py`)."""
        self.history, self.data_state, self.resumed_buffer = state["history"], state["data_state"], state["buffer"]
        self.prompts.load_state_dict(self.data_state)
        if self.adaptive_lag is not None:
            self.adaptive_lag.lag = state.get("max_lag", START_LAG)

    def start_producer(self, first_batch: int) -> RolloutProducer:
        lag = self.cfg.rollout.max_lag if self.adaptive_lag is None else self.adaptive_lag.lag
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
        completions = [records[i * k:(i + 1) * k] for i in range(len(prompts))]
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in records]
        report = self.scorer.score([prompts[c.prompt_index] for c in records], texts,
                                   [prompts[c.prompt_index].problem.answer for c in records], self.cfg.reward.on_error)
        scores = [s.reward if s.ok else None for s in report.scores]
        rewards = [scores[i * k:(i + 1) * k] for i in range(len(prompts))]
        return RolloutBatch(index=index, policy_version=min(c.policy_version for c in records), problems=[p.problem for p in prompts],
                            completions=completions, rewards=rewards, reward_errors=report.n_errors,
                            reward_timeouts=report.n_timeouts, gen_seconds=gen_seconds,
                            score_seconds=time.monotonic() - t0, data_state=data_state)

    # -- evaluation, logging -----------------------------------------------------------------------
    def evaluate(self, tag: str, version: int, tracker: NullTracker | MlflowTracker) -> float | None:
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

    def record_step(self, step: int, batch: RolloutBatch, metrics: dict[str, float],
                    tracker: NullTracker | MlflowTracker) -> None:
        """A trained step: the data position after its batch, its metrics (history, tracker, log)."""
        flat = [x for rs in batch.rewards for x in rs if x is not None]
        mean = sum(flat) / max(1, len(flat))
        std = (sum((x - mean) ** 2 for x in flat) / max(1, len(flat))) ** 0.5
        n_tokens = sum(len(c.token_ids) for cs in batch.completions for c in cs)
        pool = self.pool.stats()
        metrics.update({"rollout/prompts": float(len(batch.completions)),
                        "rollout/samples": float(sum(len(cs) for cs in batch.completions)),
                        "rollout/requeued_requests": float(pool["requeues"]),
                        "rollout/replica_restarts": float(pool["restarts"]),
                        "reward/mean": mean, "reward/std": std, "reward/errors": float(batch.reward_errors),
                        "reward/timeouts": float(batch.reward_timeouts),
                        "rollout/tokens_per_s": n_tokens / max(batch.gen_seconds, 1e-9),
                        # the learner's: every DP rank's tokens (all ranks train at once) over the step's train time
                        "train/tokens_per_s": metrics.get("train/tokens", 0.0) / max(metrics["timing/train_s"], 1e-9),
                        # rollout.weight_update=during_generation: completions whose tokens span versions
                        "rollout/multi_version_samples": float(sum(c.policy_version_max > c.policy_version
                                                                   for cs in batch.completions for c in cs)),
                        "rollout/replica_idle_s": self.producer.idle_seconds,
                        "rollout/max_lag": float(self.producer.max_lag),
                        "balance/updates_per_batch": float(self.updates_per_batch()), "balance/k": float(batch.k)})
        self.data_state = batch.data_state
        self.history.append({"step": step, **metrics})
        tracker.log_metrics(metrics, step=step)
        left = self.cfg.trainer.steps - step - 1  # the estimate: this step's wall time for each step left
        log.info("step %d/%d | reward %.3f | loss %.4f | kl %.3f | lag %.1f | gen %.1fs train %.1fs sync %.2fs "
                 "idle %.1fs | eta %.1f min", step + 1, self.cfg.trainer.steps, mean,
                 metrics.get("train/loss", float("nan")), metrics.get("kl/ref", float("nan")),
                 metrics["rollout/lag_mean"], batch.gen_seconds, metrics["timing/train_s"],
                 metrics["timing/sync_s"], metrics["timing/learner_idle_s"],
                 left * metrics["timing/step_wall_s"] / 60)

    def k(self) -> int:
        """Completions per prompt for the batches generated from now on."""
        return self.cfg.rollout.k if self.balance is None else self.balance.k

    def updates_per_batch(self) -> int:
        """T: the learner's passes over its next batch."""
        return self.cfg.trainer.updates_per_batch if self.balance is None else self.balance.updates

    def rebalance(self, step: int, metrics: dict[str, float]) -> None:
        """trainer.auto_balance: raise T or K by this step's waits of learner and replicas."""
        replica_wait = self.producer.idle_seconds - self.replica_idle_before
        self.replica_idle_before = self.producer.idle_seconds
        if self.balance is not None and self.balance.update(metrics["timing/learner_idle_s"], replica_wait,
                                                            metrics["timing/step_wall_s"]):
            log.info("step %d: %s", step, self.balance.reason)

    def adapt_lag(self, step: int, metrics: dict[str, float]) -> None:
        """rollout.max_lag: auto: move the lag by this step's staleness and learner wait."""
        if self.adaptive_lag is None or "staleness/kl_k3_mean" not in metrics:
            return  # a fixed lag, or no trained tokens this step: nothing measured
        before = self.adaptive_lag.lag
        if self.adaptive_lag.update(metrics["staleness/kl_k3_mean"], metrics["timing/learner_idle_s"],
                                    metrics["timing/step_wall_s"]):
            log.info("step %d: rollout lag %d -> %d: %s", step, before, self.adaptive_lag.lag, self.adaptive_lag.reason)
            self.producer.set_max_lag(self.adaptive_lag.lag)

    def finish(self, before: float | None, after: float | None, tracker: NullTracker | MlflowTracker,
               checkpoint: Path | None) -> None:
        """The training plot, history.json (read by `bench`) and the before -> after line."""
        run_dir, cfg = self.cfg.run_dir, self.cfg
        png = plot_training(self.history, run_dir / "training.png",
                            title=f"{cfg.run.name}: {cfg.trainer.algorithm}, max_lag={cfg.rollout.max_lag}")
        tracker.log_artifact(png)
        tracker.log_artifact(run_dir / "config.yaml")
        atomic_write_text(run_dir / "history.json", json.dumps(self.history, indent=0))
        print(run_summary(cfg, len(self.eval_prompts), before, after, wall_s=_process_seconds(), png=png,
                          checkpoint=checkpoint, tracker=tracker, log_path=log_file()), flush=True)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
        self.pool.stop()
        self.scorer.close()


def _process_seconds() -> float | None:
    """Wall time of this process so far (the run's, for a run that was not resumed)."""
    try:
        return time.time() - psutil.Process().create_time()
    except Exception:  # the process table unreadable (psutil.Error): no wall time in the summary
        return None


def run_summary(cfg: Config, n_eval: int, before: float | None, after: float | None, wall_s: float | None,
                png: Path | None, checkpoint: Path | None, tracker, log_path: Path | None) -> str:
    """The end-of-run summary printed on the terminal: the held-out metric before -> after, wall
    time, and where the outputs are (checkpoint, HF export, plot, per-problem verdicts, MLflow run
    with the command that opens its UI, log file)."""
    run_dir, metric = cfg.run_dir, EVAL_METRIC[cfg.reward.kind]
    lines = [f"== {cfg.run.name}: {cfg.trainer.algorithm}, {cfg.trainer.steps} steps, max_lag={cfg.rollout.max_lag}"]
    if before is not None and after is not None:
        lines.append(f"{metric} on {n_eval} held-out problems: before {before:.3f} -> after {after:.3f} "
                     f"({after - before:+.3f}; per problem: {run_dir / 'eval_before.json'}, eval_after.json)")
    elif after is not None:
        lines.append(f"{metric} on {n_eval} held-out problems after training: {after:.3f} ({run_dir / 'eval_after.json'})")
    if wall_s is not None:
        lines.append(f"wall time: {wall_s / 60:.1f} min")
    if checkpoint is not None:
        lines.append(f"checkpoint: {checkpoint} (resume: megatron-async train ... --resume)")
    lines.append(f"final model (HF): {run_dir / 'hf_final'}")
    if png is not None:
        lines.append(f"plot: {png}; metrics by step: {run_dir / 'history.json'}")
    uri, run_id = getattr(tracker, "uri", None), getattr(tracker, "run_id", None)
    if uri and run_id:
        lines.append(f"MLflow run {run_id} in {uri}")
        if uri.startswith("sqlite:"):
            lines.append(f"  open it: mlflow ui --backend-store-uri {uri}")
    if log_path is not None:
        lines.append(f"log (library warnings, megatron config): {log_path}")
    return "\n".join(lines)
