"""What a run shows, on rank 0: each learner step's metrics and the end-of-run report.

    report = StepReport(cfg, tracker)
    report.record(step, batch, metrics)     # per step: history, tracker, the console line
    report.finish(before, after, n_eval, checkpoint)   # plot, history.json, the summary

`history` (one dict of metrics per trained step, in step order) is the run's record for the plot
and `bench`; it is saved with every run checkpoint (`state_dict`), so a resumed run's history.json
and plot cover every step, not only those after the resume.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from megatron_async.config import Config
from megatron_async.io_utils import atomic_write_text
from megatron_async.observability.logs import log_file, say
from megatron_async.observability.plots import plot_training
from megatron_async.observability.tracking import Tracker
from megatron_async.run import TRAIN_STARTED_ENV
from megatron_async.rollout.producer import RolloutBatch
from megatron_async.run.evaluate import EVAL_METRIC, paired_test

log = logging.getLogger(__name__)


def batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The metrics a generated batch carries by itself: its size, rewards and generation speed."""
    flat = [s.reward for s in batch.samples if s.reward is not None]
    mean = sum(flat) / max(1, len(flat))
    std = (sum((x - mean) ** 2 for x in flat) / max(1, len(flat))) ** 0.5
    n_tokens = sum(len(s.token_ids) for s in batch.samples)
    return {"rollout/prompts": float(len(batch.problems)),
            "rollout/samples": float(len(batch.samples)),
            "reward/mean": mean, "reward/std": std, "reward/errors": float(batch.reward_errors),
            "reward/timeouts": float(batch.reward_timeouts), "balance/k": float(batch.k),
            "rollout/tokens_per_s": n_tokens / max(batch.gen_seconds, 1e-9),
            # rollout.weight_update=during_generation: completions whose tokens span versions
            "rollout/multi_version_samples": float(sum(s.policy_version_max is not None
                                                       and s.policy_version_max > s.policy_version
                                                       for s in batch.samples))}


@dataclass
class StepReport:
    """Rank 0's record of the run's steps (`history`) and its end-of-run outputs."""

    cfg: Config
    tracker: Tracker
    history: list[dict] = field(default_factory=list)  # per trained step: {"step": s, **metrics}

    def record(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """Learner step `step` on `batch`: adds the batch's own metrics and the learner's token rate
        to `metrics` (the learner's, timing/*, and the rollout side's), then history, tracker, console."""
        metrics.update(batch_metrics(batch))
        # the learner's: every DP rank's tokens (all ranks train at once) over the step's train time
        metrics["train/tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(metrics["timing/train_s"], 1e-9)
        self.history.append({"step": step, **metrics})
        self.tracker.log_metrics(metrics, step=step)
        left = self.cfg.trainer.steps - step - 1  # the estimate: this step's wall time for each step left
        log.info("step %d/%d | reward %.3f | loss %.4f | kl %.3f | lag %.1f | gen %.1fs train %.1fs sync %.2fs "
                 "idle %.1fs | eta %.1f min", step + 1, self.cfg.trainer.steps, metrics["reward/mean"],
                 metrics.get("train/loss", float("nan")), metrics.get("kl/ref", float("nan")),
                 metrics["rollout/lag_mean"], batch.gen_seconds, metrics["timing/train_s"],
                 metrics["timing/sync_s"], metrics["timing/learner_idle_s"],
                 left * metrics["timing/step_wall_s"] / 60)

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])

    def finish(self, before: float | None, after: float | None, n_eval: int, checkpoint: Path | None,
               resumed_at: int | None = None) -> None:
        """The training plot, history.json (read by `bench`) and the summary on the terminal
        (`resumed_at`: the step this command resumed the run at)."""
        run_dir, cfg = self.cfg.run_dir, self.cfg
        held_out = [(h["step"], h["eval/held_out"]) for h in self.history if "eval/held_out" in h]
        if before is not None:
            held_out.insert(0, (-1, before))
        if after is not None and self.history:
            held_out.append((self.history[-1]["step"], after))
        png = plot_training(self.history, run_dir / "training.png", held_out=held_out,
                            title=f"{cfg.run.name}: {cfg.trainer.algorithm}, max_lag={cfg.rollout.max_lag}")
        self.tracker.log_artifact(png)
        self.tracker.log_artifact(run_dir / "config.yaml")
        atomic_write_text(run_dir / "history.json", json.dumps(self.history, indent=0))
        paired = None
        if before is not None and after is not None and EVAL_METRIC[cfg.reward.kind] == "pass@1":
            paired = paired_test(*(json.loads((run_dir / f"eval_{tag}.json").read_text()) for tag in ("before", "after")))
        say(run_summary(cfg, n_eval, before, after, wall_s=_command_seconds(), png=png, checkpoint=checkpoint,
                        tracker=self.tracker, log_path=log_file(), paired=paired, resumed_at=resumed_at))


def _command_seconds() -> float | None:
    """Wall time of this train command so far: since the `megatron-async train` command started
    (run.TRAIN_STARTED_ENV, set by cli), or, in a rank that torchrun started from a script (launch/*.sh), since
    this process started."""
    if started := os.environ.get(TRAIN_STARTED_ENV):
        return time.time() - float(started)
    try:
        return time.time() - psutil.Process().create_time()
    except psutil.Error:  # the process table unreadable: no wall time in the summary
        return None


def run_summary(cfg: Config, n_eval: int, before: float | None, after: float | None, wall_s: float | None,
                png: Path | None, checkpoint: Path | None, tracker: Tracker, log_path: Path | None,
                paired: dict | None = None, resumed_at: int | None = None) -> str:
    """The end-of-run summary printed on the terminal: the held-out metric before -> after with,
    for exact match, the paired test (`paired`: run.evaluate.paired_test), and data.eval_size where
    data.eval held fewer problems; the wall time of this train command (`resumed_at`: the step it
    resumed the run at; the earlier commands' time is not known to it); where the outputs are
    (checkpoint, HF export, plot, per-problem verdicts, MLflow run with the command that opens its
    UI, log file)."""
    run_dir, metric = cfg.run_dir, EVAL_METRIC[cfg.reward.kind]
    lines = [f"== {cfg.run.name}: {cfg.trainer.algorithm}, {cfg.trainer.steps} steps, max_lag={cfg.rollout.max_lag}"]
    asked = cfg.data.eval_size
    if asked > n_eval and cfg.data.eval != "synthetic":  # the preflight warned: data.eval has fewer
        n_eval_text = f"{n_eval} held-out problems (all of data.eval; data.eval_size asked for {asked})"
    else:
        n_eval_text = f"{n_eval} held-out problems"
    if before is not None and after is not None:
        test = "" if paired is None else (f"; {paired['up']} problems wrong -> right, {paired['down']} right -> wrong, "
                                          f"exact McNemar p = {paired['mcnemar_p']:.2g}")
        lines.append(f"{metric} on {n_eval_text}: before {before:.3f} -> after {after:.3f} "
                     f"({after - before:+.3f}{test})")
        lines.append(f"  per problem: {run_dir / 'eval_before.json'}, eval_after.json")
    elif after is not None:
        lines.append(f"{metric} on {n_eval_text} after training: {after:.3f} ({run_dir / 'eval_after.json'})")
    if wall_s is not None and resumed_at is None:
        lines.append(f"wall time: {wall_s / 60:.1f} min (since the train command started)")
    elif wall_s is not None:
        lines.append(f"wall time: {wall_s / 60:.1f} min of this command, which resumed the run at step {resumed_at} "
                     "(the commands before it are not counted)")
    if checkpoint is not None:
        lines.append(f"checkpoint: {checkpoint} (resume: megatron-async train ... --resume)")
    lines.append(f"final model (HF): {run_dir / 'hf_final'}")
    if png is not None:
        lines.append(f"plot: {png}; metrics by step: {run_dir / 'history.json'}")
    uri, run_id = tracker.uri, tracker.run_id
    if uri and run_id:
        lines.append(f"MLflow run {run_id} in {uri}")
        if uri.startswith("sqlite:"):
            lines.append(f"  open it: mlflow ui --backend-store-uri {uri}")
    if log_path is not None:
        lines.append(f"log (library warnings, megatron config): {log_path}")
    return "\n".join(lines)
