"""PNG plots of a run's per-step metrics (written at the end of training, logged to MLflow)."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Sequence

from megatron_async.io_utils import atomic_write_bytes


def plot_training(history: list[dict], out: str | os.PathLike, title: str = "",
                  held_out: Sequence[tuple[int, float]] = ()) -> Path:
    """Six panels by learner step: reward (and `held_out`: the held-out greedy metric as (step, value)
    after that step's weights, step -1 = before training), KL to the reference, loss (and the
    fraction of weights each sync changed), time per step by phase (and the learner's padding
    fraction), the staleness monitor (KL
    generator -> learner, ESS) and the lag (measured, and the bound in force)."""
    import matplotlib  # heavy, and only needed when a plot is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]

    def series(key):
        return [h.get(key, float("nan")) for h in history]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    ax = axes[0, 0]
    ax.plot(steps, series("reward/mean"), marker=".", label="reward (mean over samples)")
    if held_out:
        ax.plot(*zip(*held_out), "s-", color="tab:orange", label="held-out, greedy (before, trainer.eval_every, after)")
        ax.legend(fontsize=8)
    ax.set_title("reward (mean over samples)")
    ax = axes[0, 1]
    ax.plot(steps, series("kl/ref"), marker=".", color="tab:red")
    ax.set_title("KL to the reference (per sequence)")
    ax = axes[1, 0]
    ax.plot(steps, series("train/loss"), marker=".", color="tab:green")
    ax.set_title("loss, and the weights each sync changed")
    changed = ax.twinx()
    changed.plot(steps, series("weight_sync/changed_fraction"), "k:", label="fraction of weights changed")
    changed.set_ylim(0, 1.05)
    changed.legend(fontsize=8, loc="upper right")
    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for key, label in [("timing/train_s", "train"), ("timing/sync_s", "weight sync"),
                       ("timing/learner_idle_s", "learner idle: waiting for the batch"),
                       ("timing/learner_wait_old_s", "learner idle: old weights still generating")]:
        vals = [0.0 if v != v else v for v in series(key)]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(steps, series("timing/generation_s"), "k.--", label="generation (replicas)")
    ax.set_title("seconds per learner step, and the learner's padding")
    ax.legend(fontsize=8)
    padding = ax.twinx()
    padding.plot(steps, series("train/padding_fraction"), "r:", label="padding fraction of microbatch tokens")
    padding.set_ylim(0, 1.05)
    padding.legend(fontsize=8, loc="lower right")
    ax = axes[0, 2]
    ax.plot(steps, series("staleness/kl_k3_mean"), marker=".", color="tab:purple", label="mean")
    ax.plot(steps, series("staleness/kl_k3_max"), marker=".", color="tab:purple", alpha=0.4, label="max")
    ax.set_title("staleness: KL(generator || learner) per token (k3)")
    ax.legend(fontsize=8)
    ess = ax.twinx()
    ess.plot(steps, series("staleness/ess_fraction"), "k:", label="ESS fraction")
    ess.set_ylim(0, 1.05)
    ess.legend(fontsize=8, loc="lower right")
    ax = axes[1, 2]
    ax.step(steps, series("rollout/max_lag"), where="post", label="bound in force (rollout.max_lag)")
    ax.plot(steps, series("rollout/lag_max"), "o", label="measured (max over the batch)")
    ax.set_title("policy lag (learner steps)")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())
