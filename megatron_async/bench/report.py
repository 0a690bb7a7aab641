"""Arithmetic and plots of `megatron-async bench`: pure functions over per-step metric histories.

A history is `RolloutState.history` (also `<run dir>/history.json`): one dict per learner step with
`timing/generation_s`, `timing/train_s`, `timing/sync_s`, `timing/learner_idle_s`,
`timing/step_wall_s`, `rollout/replica_idle_s` (cumulative over the run), `reward/mean`, `kl/ref`.

Definitions (the paper's, section 5):
- wall      = sum of `timing/step_wall_s`: the steps phase only (no set-up, SFT, or the final
              evaluations). Evaluations during the run (trainer.eval_every, `bench async
              --eval-every`) are inside it: every mode pays them, which pulls the speedup towards
              1; measure speedup and efficiency without them.
- speedup   = wall(sync, max_lag=0) / wall(async, max_lag=1), same config, seeds and steps.
- ideal     = (gen + train) / max(gen, train), from the SYNC run's per-step means: what perfect
              overlap of generation and training would give over many steps (weight sync and the
              rest stay serial; see `ideal_with_serial` for the bound that keeps them).
- efficiency = speedup / ideal.
"""
from __future__ import annotations

import io
import math
import os
import statistics
from pathlib import Path
from typing import Iterable, Sequence

from megatron_async.io_utils import atomic_write_bytes

# matplotlib is imported by the functions that draw (with the Agg backend): the arithmetic of this module
# is imported by tests and by `bench` runs that have not drawn yet, and matplotlib takes a second.

TIMING_KEYS = {
    "generation_s": "timing/generation_s",
    "train_s": "timing/train_s",
    "sync_s": "timing/sync_s",
    "learner_idle_s": "timing/learner_idle_s",
    "step_wall_s": "timing/step_wall_s",
}


def _mean(xs: Iterable[float | None]) -> float:
    kept = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(kept) / len(kept) if kept else float("nan")


def per_step_timings(history: Sequence[dict]) -> list[dict]:
    """Per step: generation, train, sync, learner idle, step wall and replica idle seconds.

    learner idle = `timing/learner_idle_s` (waiting for the batch) + `timing/learner_wait_old_s`
    (after training, waiting until the batches that need the old weights are generated).
    `rollout/replica_idle_s` is logged cumulatively (the producer's running total); it is turned
    into per-step increments here. A missing key is an error naming the step and key.
    """
    rows, prev_idle = [], 0.0
    for h in history:
        row: dict[str, float] = {"step": int(h["step"])}
        for name, key in TIMING_KEYS.items():
            if key not in h:
                raise KeyError(f"step {h['step']}: metric '{key}' missing from the history")
            row[name] = float(h[key])
        # the learner also idles after training, waiting for the batches that need its old weights
        # (logged separately as timing/learner_wait_old_s by trainers that have it)
        row["learner_idle_s"] += float(h.get("timing/learner_wait_old_s", 0.0))
        cumulative = float(h.get("rollout/replica_idle_s", prev_idle))
        row["replica_idle_s"] = max(0.0, cumulative - prev_idle)
        prev_idle = cumulative
        rows.append(row)
    return rows


def ideal_speedup(gen_s: float, train_s: float) -> float:
    """(gen + train) / max(gen, train): perfect overlap of generation and training."""
    if gen_s < 0 or train_s < 0 or max(gen_s, train_s) <= 0:
        raise ValueError(f"need non-negative times with one > 0, got gen={gen_s}, train={train_s}")
    return (gen_s + train_s) / max(gen_s, train_s)


def ideal_with_serial(gen_s: float, train_s: float, serial_s: float, steps: int | None = None) -> float:
    """The bound when `serial_s` per step (weight sync, ...) cannot overlap.

    With `steps`, also counts the pipeline fill: async must generate batch 0 before anything
    overlaps, so over S steps sync takes S(g+t+s) and async at best g + S*s + (S-1)max(g,t) + t.
    """
    if steps is None:
        return (gen_s + train_s + serial_s) / (max(gen_s, train_s) + serial_s)
    sync = steps * (gen_s + train_s + serial_s)
    async_ = gen_s + steps * serial_s + (steps - 1) * max(gen_s, train_s) + train_s
    return sync / async_


def mode_summary(history: Sequence[dict], tail: int = 3) -> dict:
    """Per-step means of the timings, the steps-phase wall time, final reward and KL of one run.

    Final reward/KL are means over the last `tail` steps (one step's reward over a small batch is
    noisy).
    """
    rows = per_step_timings(history)
    out = {f"mean_{k}": _mean(r[k] for r in rows) for k in (*TIMING_KEYS, "replica_idle_s")}
    out["steps"] = len(rows)
    out["wall_s"] = sum(r["step_wall_s"] for r in rows)
    last = list(history)[-tail:]
    out["final_reward"] = _mean(h.get("reward/mean") for h in last)
    out["final_kl"] = _mean(h.get("kl/ref") for h in last)
    return out


def final_metric(history: Sequence[dict], key: str, tail: int = 3) -> float | None:
    """Mean of `key` over the last `tail` steps that logged it (None: no step did)."""
    vals = [h[key] for h in history if h.get(key) is not None][-tail:]
    return _mean(vals) if vals else None


def quality_curve(history: Sequence[dict], evals: dict[int, float]) -> list[tuple[float, float]]:
    """[(wall seconds of the steps phase, held-out metric)] of a run's evaluations, in order.

    `evals` maps the policy version evaluated (eval_step<N>.json: N; eval_after.json: the number
    of steps) to its metric; an evaluation of version N runs inside step N-1's wall time, so it is
    placed at the cumulative `timing/step_wall_s` of steps 0..N-1."""
    walls, total = {}, 0.0
    for h in sorted(history, key=lambda h: h["step"]):
        total += h["timing/step_wall_s"]
        walls[h["step"] + 1] = total
    return [(walls[v], evals[v]) for v in sorted(evals) if v in walls]


def time_to_quality(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """Wall seconds until the first evaluation at or above `target`; None if none reached it."""
    return next((wall for wall, value in curve if value >= target), None)


def speedup_report(sync_runs: Sequence[dict], async_runs: Sequence[dict]) -> dict:
    """Speedup, ideal and efficiency from per-seed `mode_summary` dicts of both modes.

    speedup per seed = wall_sync / wall_async; the headline speedup is total sync wall over total
    async wall (all seeds); ideal from the sync runs' per-step means of generation and training.
    """
    if not sync_runs or len(sync_runs) != len(async_runs):
        raise ValueError(f"need the same number (>0) of sync and async runs, got {len(sync_runs)} and {len(async_runs)}")
    per_seed = [s["wall_s"] / a["wall_s"] for s, a in zip(sync_runs, async_runs)]
    gen = _mean(s["mean_generation_s"] for s in sync_runs)
    train = _mean(s["mean_train_s"] for s in sync_runs)
    serial = _mean(s["mean_sync_s"] for s in sync_runs)
    steps = sync_runs[0]["steps"]
    speedup = sum(s["wall_s"] for s in sync_runs) / sum(a["wall_s"] for a in async_runs)
    ideal = ideal_speedup(gen, train)
    bound = ideal_with_serial(gen, train, serial, steps)
    return {
        "speedup": speedup,
        "speedup_per_seed": per_seed,
        "speedup_spread": statistics.pstdev(per_seed) if len(per_seed) > 1 else 0.0,
        "ideal": ideal,
        "efficiency": speedup / ideal,
        "ideal_with_sync_and_fill": bound,
        "efficiency_vs_sync_and_fill": speedup / bound,
        "sync_mean_generation_s": gen,
        "sync_mean_train_s": train,
        "sync_mean_weight_sync_s": serial,
        "async_mean_generation_s": _mean(a["mean_generation_s"] for a in async_runs),
        "async_mean_train_s": _mean(a["mean_train_s"] for a in async_runs),
        # in-run contention: the same work overlapped (async) vs alone (sync), >1 = slower together
        "in_run_slowdown_generation": _mean(a["mean_generation_s"] for a in async_runs) / gen,
        "in_run_slowdown_train": _mean(a["mean_train_s"] for a in async_runs) / train,
    }


def contention(alone_rate: float, together_rate: float) -> float:
    """Fraction of throughput lost when running together: 1 - together / alone."""
    if alone_rate <= 0:
        raise ValueError(f"alone rate must be > 0, got {alone_rate}")
    return 1.0 - together_rate / alone_rate


# ----------------------------------------------------------------------------- plots


def _save(fig, out: str | os.PathLike) -> Path:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())


def plot_timeline(runs: dict[str, Sequence[dict]], out: str | os.PathLike, title: str = "") -> Path:
    """Per step, per mode: learner idle/train/sync stacked bars, generation beside; cumulative wall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(5.5 * (len(runs) + 1), 4.5))
    colors = {"learner_idle_s": "tab:gray", "train_s": "tab:blue", "sync_s": "tab:red"}
    ymax = 0.0
    for ax, (label, history) in zip(axes, runs.items()):
        rows = per_step_timings(history)
        steps = [r["step"] for r in rows]
        bottom = [0.0] * len(rows)
        for key, color in colors.items():
            vals = [r[key] for r in rows]
            ax.bar([s - 0.2 for s in steps], vals, width=0.4, bottom=bottom, color=color,
                   label=f"learner: {key[:-2].replace('_', ' ')}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        rest = [max(0.0, r["step_wall_s"] - b) for r, b in zip(rows, bottom)]  # bars add up to the step wall
        ax.bar([s - 0.2 for s in steps], rest, width=0.4, bottom=bottom, color="tab:olive",
               label="learner: other (untimed waits, logging)")
        bottom = [b + v for b, v in zip(bottom, rest)]
        ax.bar([s + 0.2 for s in steps], [r["generation_s"] for r in rows], width=0.4, color="tab:green",
               label="replicas: generation")
        ax.set_title(label)
        ax.set_xlabel("learner step")
        ax.set_ylabel("seconds")
        ymax = max(ymax, max(bottom + [r["generation_s"] for r in rows]))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    for ax in axes[:-1]:
        ax.set_ylim(0, ymax * 1.1)
    ax = axes[-1]
    for label, history in runs.items():
        rows = per_step_timings(history)
        cum, total = [], 0.0
        for r in rows:
            total += r["step_wall_s"]
            cum.append(total)
        ax.plot([r["step"] for r in rows], cum, marker="o", label=label)
    ax.set_title("cumulative wall time (steps phase)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out)


def _sweep_label(r: dict) -> str:
    """An algorithm, with its off-policy correction where it takes one ("ppo+tis")."""
    c = r.get("correction") or ""
    return r["algorithm"] + (f"+{c}" if c and c != "n/a" else "")


def plot_sweep(rows: Sequence[dict], out: str | os.PathLike, title: str = "") -> Path:
    """Final training reward vs KL per N (one line per algorithm and correction); T and K panels.
    Rows are runs or `aggregate_sweep`'s means over seeds (same keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("final_kl") is not None]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, knob, name in zip(axes, ("N", "T", "K"), ("minibatches N", "updates per batch T", "samples per prompt K")):
        for label in sorted({_sweep_label(r) for r in ok if r["knob"] == knob}):
            pts = sorted((r for r in ok if r["knob"] == knob and _sweep_label(r) == label), key=lambda r: r["value"])
            ax.plot([p["final_kl"] for p in pts], [p["final_reward"] for p in pts], marker="o", label=label)
            for p in pts:
                ax.annotate(f"{knob}={p['value']}", (p["final_kl"], p["final_reward"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_title(f"final reward vs KL, by {name}")
        ax.set_xlabel("KL to reference (final)")
        ax.set_ylabel("reward (final)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    skipped = sorted({f"{_sweep_label(r)} {r['knob']}={r['value']}: {r['status'][:70]}"
                      for r in rows if r.get("status") != "ok"})
    fig.suptitle(title + ("\nskipped: " + "; ".join(skipped) if skipped else ""), fontsize=9)
    fig.tight_layout()
    return _save(fig, out)


def plot_figure4(runs: Sequence[dict], agg: Sequence[dict], out: str | os.PathLike, title: str = "") -> Path:
    """The paper's Figure 4 analogue over the N runs: held-out pass@1 after training (left) and final
    training reward (right) vs final KL to the reference. One colour per algorithm, solid without
    a correction, dashed with one; big markers and the line (in order of N) are means over seeds,
    error bars their half-range, small faint markers the single runs; the dotted line is the
    starting model's held-out pass@1 (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = [r for r in agg if r["knob"] == "N" and r.get("status") == "ok" and r.get("final_kl") is not None]
    singles = [r for r in runs if r["knob"] == "N" and r.get("status") == "ok" and r.get("final_kl") is not None]
    algorithms = sorted({r["algorithm"] for r in means})
    colours = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(algorithms)}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, key, name in zip(axes, ("pass_at_1_after", "final_reward"),
                             ("held-out pass@1 after training", "training reward (final)")):
        for label in sorted({_sweep_label(r) for r in means}):
            pts = sorted((r for r in means if _sweep_label(r) == label and r.get(key) is not None),
                         key=lambda r: r["value"])
            if not pts:
                continue
            colour = colours[pts[0]["algorithm"]]
            style = "-" if (pts[0].get("correction") or "none") in ("none", "n/a", "") else "--"
            ax.errorbar([p["final_kl"] for p in pts], [p[key] for p in pts],
                        xerr=[p["final_kl_spread"] or 0 for p in pts], yerr=[p[f"{key}_spread"] or 0 for p in pts],
                        color=colour, linestyle=style, marker="o" if style == "-" else "s", capsize=2, label=label)
            for p in pts:
                ax.annotate(f"N={p['value']}", (p["final_kl"], p[key]), fontsize=7, textcoords="offset points",
                            xytext=(4, 3), color=colour)
            one = [r for r in singles if _sweep_label(r) == label and r.get(key) is not None]
            ax.scatter([r["final_kl"] for r in one], [r[key] for r in one], color=colour, s=10, alpha=0.35)
        if key == "pass_at_1_after":
            before = [r["pass_at_1_before"] for r in singles if r.get("pass_at_1_before") is not None]
            if before:
                ax.axhline(sum(before) / len(before), color="gray", linestyle=":", label="before (SFT model)")
        ax.set_title(f"{name} vs KL, by minibatches N")
        ax.set_xlabel("KL to reference (final)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, out)
