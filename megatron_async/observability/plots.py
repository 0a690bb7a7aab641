"""PNG plots of a run's per-step metrics (written at the end of training, logged to MLflow)."""
from __future__ import annotations

import os
from pathlib import Path


def plot_training(history: list[dict], out: str | os.PathLike, title: str = "") -> Path:
    """Four panels by learner step: reward, KL to reference, loss, and time per step by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_async.io_utils import atomic_write_bytes

    steps = [h["step"] for h in history]

    def series(key):
        return [h.get(key, float("nan")) for h in history]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    ax.plot(steps, series("reward/mean"), marker=".")
    ax.set_title("reward (mean over samples)")
    ax = axes[0, 1]
    ax.plot(steps, series("kl/ref"), marker=".", color="tab:red")
    ax.set_title("KL to the reference (per sequence)")
    ax = axes[1, 0]
    ax.plot(steps, series("train/loss"), marker=".", color="tab:green")
    ax.set_title("loss")
    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for key, label in [("timing/train_s", "train"), ("timing/sync_s", "weight sync"),
                       ("timing/learner_idle_s", "learner idle: waiting for the batch"),
                       ("timing/learner_wait_old_s", "learner idle: old weights still generating")]:
        vals = [0.0 if v != v else v for v in series(key)]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(steps, series("timing/generation_s"), "k.--", label="generation (replicas)")
    ax.set_title("seconds per learner step")
    ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())
