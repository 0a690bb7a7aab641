"""`megatron-async bench`: the asynchronous speedup, the paper's off-policy sweep, rollout throughput.

    megatron-async bench async configs/cpu_tiny.yaml [overrides] --seeds 1 2 --out-dir runs/bench_async
    megatron-async bench sweep configs/cpu_tiny.yaml [overrides] --out-dir runs/bench_sweep
    megatron-async bench rollout [bench/rollout.py arguments]   # replica start-up, tokens/s, sync seconds
    megatron-async bench learner [bench/learner.py arguments]   # our learner step vs plain PyTorch
    megatron-async bench lm-head [CHUNK_MB ...]                 # the LM head alone, whole vs chunked
    megatron-async bench checkpoint [bench/checkpoint.py arguments]   # a save's cost, sync vs async
    megatron-async bench sync-profile [--models tiny smollm2]    # a replica's side of a sync, per phase

`async`: the same config, seeds and steps are trained with rollout.max_lag=0 (synchronous
baseline) and max_lag=1 (one-step off-policy), each as a subprocess `python -m megatron_async
train` into its own run dir, in ABBA order per seed pair (sync, async, async, sync, ...) so slow
drift of a shared machine's load hits both modes alike. Per-step timings come from each run's
`history.json` (`bench/report.py` has the arithmetic). SFT runs once (its model is shared by every
run, `sft.steps=0` afterwards), so runs differ only in what is measured. With `--contention` it also
measures generation and training alone vs together on the pinned cores (`bench/contention.py`);
with `--rollout` it folds `bench rollout`'s tokens/s ratio and sync seconds in. `--modes
auto balance` adds runs with rollout.max_lag=auto and with trainer.auto_balance; `--eval-every E`
evaluates every E steps and reports the paper's headline, each mode's wall time to the sync run's
final held-out pass@1 and its ratio to sync (`time_to_quality`).
Writes `bench_async.json` and `bench_async_timeline.png` into --out-dir.

`sweep`: N (trainer.minibatches) for each algorithm, then T (trainer.updates_per_batch) and K
(rollout.k) for the first algorithm; `--corrections none tis` runs each policy-gradient algorithm
(ppo, rloo, proximal_rloo, grpo) once per trainer.off_policy_correction (online_dpo takes none:
once), `--seeds 0 1` repeats everything per run.seed (outer loop). Final training reward, KL to
the reference and held-out pass@1 per run (256 problems by default: one is 0.39%); `sweep.csv`
(runs), `sweep.md` (mean ± half-range over seeds), `sweep.json`, `sweep.png` (training reward vs
KL by N, T, K) and `figure4.png` (held-out pass@1 and training reward vs KL by N: the paper's
Figure 4 analogue), rewritten after every run. The default is sized for ~10-15 min on 2 shared
cores; the measured Figure 4 sweep is in docs/off-policy.md.

CPU layout: by default (`--pin auto`) the runs keep the config's parallel.learner_cpus /
rollout.replica_cpus, whose "auto" splits the CPUs between learner and replicas (2 CPUs: learner
0, replica 1; cluster/cpu_affinity.py), as the paper puts them on separate GPUs; `--pin none`
leaves both unpinned, `--pin L:R` sets both; explicit overrides win. Load averages are recorded
around every run: numbers from a shared machine are only comparable within one invocation.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron_async.algorithms import ALGORITHMS
from megatron_async.bench import report
from megatron_async.bench.contention import run_contention
from megatron_async.cluster.placement import cpu_plan
from megatron_async.config import ConfigError, load_config
from megatron_async.io_utils import atomic_write_text

STEP_LINE = re.compile(rb"\bstep (\d+) \| reward")


class BenchError(RuntimeError):
    """A benchmark run failed; the message carries the run's log tail."""


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_avg_1_5_15": list(os.getloadavg()), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def pin_overrides(pin: str) -> list[str]:
    """--pin auto|none|LEARNER:REPLICA -> config overrides (auto: none, the trainer's own CPU plan)."""
    if pin == "none":
        return ["parallel.learner_cpus=", "rollout.replica_cpus="]
    if pin == "auto":
        return []
    learner, sep, replica = pin.partition(":")
    if not sep:
        raise SystemExit(f"--pin {pin!r}: expected auto, none or LEARNER:REPLICA CPU lists, e.g. 0:1")
    return [f"parallel.learner_cpus={learner}", f"rollout.replica_cpus={replica}"]


# ----------------------------------------------------------------------------- running trainings


def run_training(config: str, overrides: list[str], out_dir: Path, name: str, label: str = "",
                 timeout_s: float = 3600.0, steps: int | None = None) -> dict:
    """`python -m megatron_async train` into out_dir/name; returns history, evals, load, seconds.

    Shows a progress bar fed by the run's per-step log lines. Raises BenchError on failure.
    """
    run_dir = out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale run dir would be resumed/reused
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "megatron_async", "train", config, *overrides,
           f"run.out_dir={out_dir}", f"run.name={name}"]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    bar = tqdm(total=steps, desc=label or name, unit="step", leave=True, mininterval=1)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        seen = 0
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                done = len(STEP_LINE.findall(log_path.read_bytes()))
                if done > seen:
                    bar.update(done - seen)
                    seen = done
                if time.monotonic() - t0 > timeout_s:
                    proc.kill()
                    raise BenchError(f"{name}: no result after {timeout_s:.0f} s; log: {log_path}")
        finally:
            if proc.poll() is None:
                proc.kill()
            bar.close()
    tail = log_path.read_bytes()[-3000:].decode(errors="replace")
    if proc.returncode != 0:
        raise BenchError(f"{name}: train exited {proc.returncode}; log {log_path}:\n{tail}")
    history_path = run_dir / "history.json"
    if not history_path.exists():
        raise BenchError(f"{name}: {history_path} was not written (trainer too old?); log {log_path}")
    result: dict[str, Any] = {"name": name, "command": " ".join(cmd), "run_dir": str(run_dir), "log": str(log_path),
              "seconds_total": time.monotonic() - t0, "load_avg_before": list(load_before),
              "load_avg_after": list(os.getloadavg()), "history": json.loads(history_path.read_text())}
    for tag in ("before", "after"):
        p = run_dir / f"eval_{tag}.json"
        if p.exists():
            ev = json.loads(p.read_text())
            result[f"pass_at_1_{tag}"], result["eval_n"] = ev["pass@1"], ev["n"]
    evals = {}  # policy version -> the held-out metric (pass@1, or the RM score)
    for p in run_dir.glob("eval_step*.json"):
        ev = json.loads(p.read_text())
        evals[int(p.stem.removeprefix("eval_step"))] = ev[ev["metric"]]
    if "pass_at_1_after" in result:
        evals[len(result["history"])] = result["pass_at_1_after"]
    result["quality_curve"] = report.quality_curve(result["history"], evals)
    return result


def prepare_sft(config: str, overrides: list[str], out_dir: Path, timeout_s: float,
                init_model: str | None = None) -> list[str]:
    """SFT once (trainer.steps=0) and return overrides that start every run from its model."""
    if init_model:  # an SFT'd HF checkpoint from an earlier bench (e.g. runs/bench_async/sft/sft_model)
        if not (Path(init_model) / "config.json").exists():
            raise BenchError(f"--init-model {init_model}: no config.json there")
        return [f"model.hf_path={Path(init_model).resolve()}", "sft.steps=0"]
    cfg = load_config(config, overrides)
    if cfg.sft.steps == 0:
        return []
    run = run_training(config, [*overrides, "trainer.steps=0", "data.eval_size=1"], out_dir, "sft", "SFT (shared)",
                       timeout_s=timeout_s)
    model = Path(run["run_dir"]) / "sft_model"
    if not (model / "config.json").exists():
        raise BenchError(f"SFT run finished without {model}")
    return [f"model.hf_path={model.resolve()}", "sft.steps=0"]


# ----------------------------------------------------------------------------- bench async


def bench_async(args) -> int:
    out_dir = Path(args.out_dir).resolve()
    base = [*pin_overrides(args.pin), *args.overrides, "trainer.checkpoint_every=0"]
    if args.eval_every:
        base.append(f"trainer.eval_every={args.eval_every}")
    started = machine()
    shared = prepare_sft(args.config, base, out_dir, args.timeout_s, args.init_model)
    cfg = load_config(args.config, [*base, *shared])
    cpus = cpu_plan(cfg)  # the CPU lists each run's learner resolves to (its "auto" on this machine)
    order = []
    for i, seed in enumerate(args.seeds):
        modes = (0, 1) if i % 2 == 0 else (1, 0)  # ABBA
        order += [(seed, lag) for lag in modes]
    runs: dict[tuple[int, int], dict] = {}
    for seed, lag in order:
        name = f"{'sync' if lag == 0 else 'async'}_seed{seed}"
        runs[(seed, lag)] = run_training(args.config, [*base, *shared, f"rollout.max_lag={lag}", f"run.seed={seed}"],
                                         out_dir / "runs", name, label=name, timeout_s=args.timeout_s,
                                         steps=cfg.trainer.steps)
    extra = {mode: {seed: run_training(args.config, [*base, *shared, *QUALITY_MODES[mode], f"run.seed={seed}"],
                                       out_dir / "runs", f"{mode}_seed{seed}", label=f"{mode}_seed{seed}",
                                       timeout_s=args.timeout_s, steps=cfg.trainer.steps)
                    for seed in args.seeds} for mode in args.modes}
    sync = [report.mode_summary(runs[(s, 0)]["history"]) for s in args.seeds]
    asyn = [report.mode_summary(runs[(s, 1)]["history"]) for s in args.seeds]
    result: dict[str, Any] = {
        "command": "megatron-async bench " + " ".join(args.argv),
        "machine_start": started, "machine_end": machine(),
        "pinning": {"learner_cpus": cpus.learner, "replica_cpus": cpus.replica, "why": cpus.why},
        "config": {"algorithm": cfg.trainer.algorithm, "steps": cfg.trainer.steps,
                   "prompts_per_step": cfg.rollout.prompts_per_step, "k": cfg.rollout.k,
                   "max_new_tokens": cfg.rollout.max_new_tokens, "hidden": cfg.model.tiny_hidden_size,
                   "layers": cfg.model.tiny_layers},
        "summary": report.speedup_report(sync, asyn),
        "quality": {mode: {"final_reward": [r["final_reward"] for r in rs], "final_kl": [r["final_kl"] for r in rs],
                           "pass_at_1_after": [runs[(s, lag)].get("pass_at_1_after") for s in args.seeds]}
                    for mode, rs, lag in (("sync", sync, 0), ("async", asyn, 1))},
        "modes": {mode: [{"seed": s, "pass_at_1_after": r.get("pass_at_1_after"), **report.mode_summary(r["history"])}
                         for s, r in by_seed.items()] for mode, by_seed in extra.items()},
        "runs": [{"seed": s, "max_lag": lag, **{k: v for k, v in runs[(s, lag)].items() if k != "history"},
                  "summary": report.mode_summary(runs[(s, lag)]["history"]),
                  "per_step": report.per_step_timings(runs[(s, lag)]["history"])} for s, lag in order],
    }
    if args.eval_every:  # the paper's headline: wall time to the sync run's final held-out pass@1
        curves = {"sync": {s: runs[(s, 0)] for s in args.seeds}, "async": {s: runs[(s, 1)] for s in args.seeds},
                  **extra}
        result["time_to_quality"] = time_to_quality_report(curves, args.seeds)
    if args.contention:
        model = Path(cfg.model.hf_path) if cfg.model.hf_path != "tiny" else None
        result["contention"] = run_contention(model or Path(runs[order[0]]["run_dir"]) / "base_model",
                                              cpus.learner, cpus.replica,
                                              seconds=args.contention_s, out_dir=out_dir)
    if args.rollout:
        result["rollout"] = fold_rollout(out_dir, ["--models", "tiny", "--syncs", "3"])
    json_path = atomic_write_text(out_dir / "bench_async.json", json.dumps(result, indent=1))
    seed = args.seeds[0]
    png = report.plot_timeline({f"sync (max_lag=0), seed {seed}": runs[(seed, 0)]["history"],
                                f"async (max_lag=1), seed {seed}": runs[(seed, 1)]["history"]},
                               out_dir / "bench_async_timeline.png",
                               title=f"{cfg.trainer.algorithm}: per-step seconds, learner CPUs "
                                     f"'{cpus.learner}', replica CPUs '{cpus.replica}'")
    s = result["summary"]
    print(f"speedup {s['speedup']:.3f} (per seed {', '.join(f'{x:.3f}' for x in s['speedup_per_seed'])}) | "
          f"ideal {s['ideal']:.3f} | efficiency {s['efficiency']:.3f} | "
          f"load {started['load_avg_1_5_15'][0]:.1f} -> {result['machine_end']['load_avg_1_5_15'][0]:.1f}")
    for mode, q in result["quality"].items():
        print(f"{mode}: final reward {q['final_reward']} final KL {q['final_kl']} pass@1 after {q['pass_at_1_after']}")
    for mode, rows in result["modes"].items():
        print(f"{mode}: mean step {[round(r['mean_step_wall_s'], 2) for r in rows]} s, final reward "
              f"{[r['final_reward'] for r in rows]}, pass@1 after {[r['pass_at_1_after'] for r in rows]}")
    for mode, t in result.get("time_to_quality", {}).items():
        print(f"time to sync's final pass@1, {mode}: {t['seconds']} s, ratio to sync {t['ratio_to_sync']}")
    print(f"wrote {json_path} and {png}")
    return 0


QUALITY_MODES = {  # `bench async --modes`: runs beside sync (max_lag=0) and async (max_lag=1)
    "auto": ["rollout.max_lag=auto"],
    "balance": ["rollout.max_lag=1", "trainer.auto_balance=true"],
    "during": ["rollout.max_lag=1", "rollout.weight_update=during_generation"],  # PipelineRL-style updates
}


def time_to_quality_report(runs: dict[str, dict[int, dict]], seeds: list[int]) -> dict:
    """Per mode and seed: the wall seconds (steps phase) until the first evaluation at or above the
    sync run's final pass@1 of that seed, and the ratio to sync's own (None: never reached)."""
    out = {}
    for mode, by_seed in runs.items():
        seconds: list[float | None] = []
        ratios: list[float | None] = []
        for s in seeds:
            target = runs["sync"][s]["quality_curve"][-1][1]
            sync_t = report.time_to_quality(runs["sync"][s]["quality_curve"], target)
            t = report.time_to_quality(by_seed[s]["quality_curve"], target)
            seconds.append(t)
            ratios.append(None if t is None or sync_t is None else t / sync_t)
        out[mode] = {"seconds": seconds, "ratio_to_sync": ratios}
    return out


def fold_rollout(out_dir: Path, argv: list[str]) -> dict:
    """Run `bench rollout` (a process of its own) and keep the figures the report needs."""
    path = out_dir / "bench_rollout.json"
    cmd = [sys.executable, "-m", "megatron_async", "bench", "rollout", *argv, "--out", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"bench_rollout failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    data = json.loads(path.read_text())
    folded: dict[str, Any] = {"command": " ".join(cmd), "models": []}
    for m in data["models"]:
        if "skipped" in m:
            folded["models"].append(m)
            continue
        syncs = [s["seconds"] for s in m["syncs"]]
        folded["models"].append({
            "model": m["model"], "parameters": m["parameters"],
            "pool_tokens_per_s": m["pool"]["tokens_per_s"], "transformers_tokens_per_s": m["transformers"]["tokens_per_s"],
            "ratio_pool_over_transformers": m["ratio_pool_over_transformers"],
            "sync_seconds_mean": sum(syncs) / len(syncs), "sync_gb_per_s": [s["gb_per_s"] for s in m["syncs"]],
            "load_avg": m["pool"]["load_avg"]})
    return folded


# ----------------------------------------------------------------------------- bench sweep


NO_CORRECTION = "n/a"  # the correction label of algorithms that take none (online_dpo, best_of_k_sft)


def takes_correction(algorithm: str) -> bool:
    """Whether `trainer.off_policy_correction` reaches this algorithm's loss (ppo, rloo, proximal_rloo, grpo)."""
    return ALGORITHMS[algorithm].corrects_off_policy


def sweep_plan(algorithms: list[str], ns: list[int], ts: list[int], ks: list[int],
               corrections: list[str] | None = None, seeds: list[int] | None = None,
               corrected: set[str] | None = None) -> list[dict]:
    """Runs of the sweep, per seed: N for every algorithm x correction, then T and K for the first
    algorithm with its first correction (N=1, T=1, K=config).

    `corrections` (trainer.off_policy_correction values) apply to the algorithms in `corrected`
    (default: those whose loss takes one, `takes_correction`); the others run once, labelled
    NO_CORRECTION. No corrections: the config's own, labelled "". No seeds: the config's run.seed
    (seed None). Seeds are the outer loop, so a sweep stopped early holds complete seeds.
    """
    corrections = list(corrections or [])
    if corrected is None:
        corrected = {a for a in algorithms if takes_correction(a)}

    def variants(a: str) -> list[tuple[str, list[str]]]:
        if not corrections:
            return [("", [])]
        if a not in corrected:
            return [(NO_CORRECTION, [])]
        return [(c, [f"trainer.off_policy_correction={c}"]) for c in corrections]

    plan = []
    outer: list[int | None] = [*seeds] if seeds else [None]
    for seed in outer:
        seeded = [] if seed is None else [f"run.seed={seed}"]
        cells = [(a, c, o, "N", n, [f"trainer.minibatches={n}"]) for a in algorithms for c, o in variants(a)
                 for n in ns]
        if algorithms:
            (c, o), a = variants(algorithms[0])[0], algorithms[0]
            cells += [(a, c, o, "T", t, [f"trainer.updates_per_batch={t}"]) for t in ts]
            cells += [(a, c, o, "K", k, [f"rollout.k={k}"]) for k in ks]
        for a, c, o, knob, value, knob_o in cells:
            name = f"{a}_{knob}{value}" + (f"_{c}" if c and c != NO_CORRECTION else "") + \
                   ("" if seed is None else f"_seed{seed}")
            plan.append({"algorithm": a, "correction": c, "seed": seed, "knob": knob, "value": value,
                         "name": name, "overrides": [*knob_o, *o, *seeded]})
    return plan


def bench_sweep(args) -> int:
    out_dir = Path(args.out_dir).resolve()
    started = machine()
    algorithms = args.algorithms
    rows: list[dict[str, Any]] = []
    base = [*pin_overrides(args.pin), f"rollout.max_lag={args.max_lag}", *args.overrides,
            "trainer.checkpoint_every=0"]
    shared = prepare_sft(args.config, base, out_dir, args.timeout_s, args.init_model)
    cfg = load_config(args.config, [*base, *shared])
    plan = sweep_plan(algorithms, args.n, [t for t in args.t if t != 1], [k for k in args.k if k != cfg.rollout.k],
                      args.corrections, args.seeds)
    meta = {"command": "megatron-async bench " + " ".join(args.argv), "machine_start": started,
            "max_lag": args.max_lag, "steps": cfg.trainer.steps, "prompts_per_step": cfg.rollout.prompts_per_step,
            "k": cfg.rollout.k, "eval_size": cfg.data.eval_size, "planned_runs": len(plan)}
    earlier = resumable_rows(out_dir / "sweep.json", meta) if args.resume else {}
    if args.resume and (out_dir / "sweep.json").exists():
        old = json.loads((out_dir / "sweep.json").read_text())
        meta["commands"] = [*old.get("commands", [old["command"]]), meta["command"]]
    planned = {sweep_key(item) for item in plan}
    kept = [r for key, r in earlier.items() if key not in planned]  # earlier runs this plan does not hold
    t0, reused = time.monotonic(), 0

    def write(done: int, quiet: bool) -> None:
        progress = {"machine_end": machine(), "finished_runs": done, "reused_runs": reused,
                    "kept_earlier_runs": len(kept), "seconds": time.monotonic() - t0}
        write_sweep(out_dir, with_base_rows([*rows, *kept], cfg.rollout.k), {**meta, **progress}, quiet=quiet)
    for i, item in enumerate(plan):
        name = item["name"]
        row = {k: v for k, v in item.items() if k not in ("overrides", "name")}
        if sweep_key(row) in earlier:  # --resume: this run finished in an earlier invocation
            rows.append(earlier[sweep_key(row)])
            reused += 1
            continue
        try:
            extra = [f"trainer.algorithm={item['algorithm']}", *item["overrides"]]
            run = run_training(args.config, [*base, *shared, *extra], out_dir / "runs", name,
                               label=f"[{i + 1}/{len(plan)}] {name}", timeout_s=args.timeout_s, steps=cfg.trainer.steps)
            summ = report.mode_summary(run["history"])
            row.update(status="ok", final_reward=summ["final_reward"], final_kl=summ["final_kl"],
                       pass_at_1_before=run.get("pass_at_1_before"), pass_at_1_after=run.get("pass_at_1_after"),
                       eval_n=run.get("eval_n"), wall_s=summ["wall_s"], seconds_total=run["seconds_total"],
                       load_avg_1min=run["load_avg_before"][0],
                       staleness_kl=report.final_metric(run["history"], "staleness/kl_k3_mean"),
                       staleness_iw=report.final_metric(run["history"], "staleness/iw_mean"))
        except BenchError as e:
            row.update(status=f"failed: {str(e).splitlines()[0]}")
            print(e, file=sys.stderr)
        rows.append(row)
        write(i + 1, quiet=True)  # after every run, so a sweep stopped early still leaves its table and plots
    write(len(plan), quiet=False)
    return 0


RESUME_MUST_MATCH = ("max_lag", "steps", "prompts_per_step", "k", "eval_size")


def sweep_key(row: dict) -> tuple:
    return row["algorithm"], row.get("correction", ""), row.get("seed"), row["knob"], row["value"]


def resumable_rows(path: Path, meta: dict) -> dict[tuple, dict]:
    """--resume: the finished runs (status ok, not a same_run_as copy) of an earlier sweep.json,
    by sweep_key; none if there is none. An earlier sweep of other sizes is refused (BenchError)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    differ = [f"{k} {earlier.get(k)} != {meta[k]}" for k in RESUME_MUST_MATCH if earlier.get(k) != meta[k]]
    if differ:
        raise BenchError(f"--resume: {path} is of another sweep ({', '.join(differ)}); use another --out-dir")
    return {sweep_key(r): dict(r, resumed=True) for r in earlier["rows"]
            if r.get("status") == "ok" and not r.get("same_run_as")}


def with_base_rows(rows: list[dict], k: int) -> list[dict]:
    """`rows` plus, per seed, the first algorithm's first N=1 run again as T=1 and K=`k` (it is
    both: plotted in those panels too, marked same_run_as)."""
    first = next((r for r in rows if r["knob"] == "N"), None)
    if first is None:
        return list(rows)
    out = list(rows)
    for r in rows:
        if (r["knob"] == "N" and r["value"] == 1 and r["status"] == "ok" and r["algorithm"] == first["algorithm"]
                and r.get("correction", "") == first.get("correction", "")):
            out += [dict(r, knob="T", value=1, same_run_as="N=1"), dict(r, knob="K", value=k, same_run_as="N=1")]
    return out


AGGREGATED = ("pass_at_1_after", "final_reward", "final_kl", "pass_at_1_before", "wall_s", "staleness_kl")


def aggregate_sweep(rows: list[dict]) -> list[dict]:
    """One row per (algorithm, correction, knob, value) over its seeds, in first-seen order: for
    each metric of AGGREGATED its mean over the runs that finished, `<metric>_spread` = half the
    range (max - min) / 2 (for two seeds: the distance of each from the mean) and `<metric>_values`;
    `seeds` = the seeds of the finished runs, `failed` = how many did not finish."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r.get("correction", ""), r["knob"], r["value"]), []).append(r)
    out = []
    for (algorithm, correction, knob, value), rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        row = {"algorithm": algorithm, "correction": correction, "knob": knob, "value": value,
               "status": "ok" if ok else rs[0].get("status", "failed"), "seeds": [r.get("seed") for r in ok],
               "failed": len(rs) - len(ok)}
        if any(r.get("same_run_as") for r in rs):
            row["same_run_as"] = rs[0]["same_run_as"]
        for key in AGGREGATED:
            vals = [float(r[key]) for r in ok if r.get(key) is not None]
            row[f"{key}_values"] = vals
            row[key] = sum(vals) / len(vals) if vals else None
            row[f"{key}_spread"] = (max(vals) - min(vals)) / 2 if vals else None
        out.append(row)
    return out


def _pm(row: dict, key: str, digits: int = 3) -> str:
    if row.get(key) is None:
        return "-"
    spread = f" ± {row[f'{key}_spread']:.{digits}f}" if len(row[f"{key}_values"]) > 1 else ""
    return f"{row[key]:.{digits}f}{spread}"


def sweep_table(agg: list[dict]) -> str:
    """Markdown: algorithm, correction, knob=value, seeds finished, held-out pass@1 after, final
    training reward and KL to the reference, each mean ± half-range over seeds."""
    lines = ["| algorithm | correction | run | seeds | held-out pass@1 after | train reward (final) | KL to ref (final) |",
             "|---|---|---|---|---|---|---|"]
    for r in agg:
        if r.get("same_run_as"):
            continue
        seeds = str(len(r["seeds"])) + (f" ({r['failed']} failed)" if r["failed"] else "")
        lines.append(f"| {r['algorithm']} | {r['correction'] or 'config'} | {r['knob']}={r['value']} | {seeds} | "
                     f"{_pm(r, 'pass_at_1_after')} | {_pm(r, 'final_reward')} | {_pm(r, 'final_kl')} |")
    return "\n".join(lines) + "\n"


def write_sweep(out_dir: Path, rows: list[dict], meta: dict, quiet: bool = False) -> None:
    """sweep.csv (one row per run), sweep.json (runs and aggregates), sweep.md (the table over
    seeds), sweep.png (training reward vs KL by N, T, K) and figure4.png (held-out pass@1 and
    training reward vs KL by N, per algorithm and correction: the paper's Figure 4); atomic writes."""
    agg = aggregate_sweep(rows)
    fields = ["algorithm", "correction", "seed", "knob", "value", "status", "final_reward", "final_kl",
              "pass_at_1_before", "pass_at_1_after", "eval_n", "staleness_kl", "staleness_iw", "wall_s",
              "seconds_total", "load_avg_1min", "same_run_as"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "sweep.csv", buf.getvalue())
    atomic_write_text(out_dir / "sweep.json", json.dumps({**meta, "rows": rows, "aggregate": agg}, indent=1))
    table = sweep_table(agg)
    before = [v for r in agg for v in r["pass_at_1_before_values"]]
    head = (f"`{meta.get('command', '')}`\n\nmax_lag={meta.get('max_lag')}, {meta.get('steps')} steps x "
            f"{meta.get('prompts_per_step')} prompts x K={meta.get('k')}, {meta.get('eval_size')} held-out problems; "
            f"{meta.get('finished_runs', len(rows))} of {meta.get('planned_runs', len(rows))} planned runs; "
            f"mean ± half-range over seeds" +
            (f"; held-out pass@1 before {min(before):.3f}-{max(before):.3f}" if before else "") + "\n\n")
    atomic_write_text(out_dir / "sweep.md", head + table)
    title = (f"off-policy sweep (max_lag={meta.get('max_lag')}, {meta.get('steps')} steps, "
             f"{meta.get('prompts_per_step')} prompts/step)")
    png = report.plot_sweep(agg, out_dir / "sweep.png", title=title + ", means over seeds")
    fig4 = report.plot_figure4(rows, agg, out_dir / "figure4.png",
                               title=title + f", {meta.get('eval_size')} held-out problems")
    if not quiet:
        print(buf.getvalue())
        print(table)
        print(f"wrote {out_dir / 'sweep.csv'}, sweep.json, sweep.md, {png} and {fig4}")


# ----------------------------------------------------------------------------- entry point

# `bench sweep` prepends these unless --full: ~6 short runs' worth of compute per algorithm
# 256 held-out problems: one problem is 0.39% of pass@1
SWEEP_DEFAULTS = ["trainer.steps=6", "rollout.prompts_per_step=16", "data.eval_size=256", "trainer.micro_batch_size=16"]
SMALL = ["model.tiny_hidden_size=64", "model.tiny_heads=2", "model.tiny_kv_heads=2", "model.tiny_layers=2",
         "sft.steps=200", "sft.batch_size=32", "trainer.steps=8", "rollout.prompts_per_step=16",
         "rollout.max_new_tokens=32", "data.eval_size=32", "trainer.micro_batch_size=16"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-async bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)

    def common(sp):
        sp.add_argument("config")
        sp.add_argument("overrides", nargs="*", help="section.key=value (after the defaults of --small)")
        sp.add_argument("--out-dir", default=None)
        sp.add_argument("--pin", default="auto",
                        help="auto (the config's CPU keys; unset, they split the CPUs), none (unpinned), or L:R")
        sp.add_argument("--timeout-s", type=float, default=3600.0, help="per training run")
        sp.add_argument("--init-model", default=None,
                        help="start every run from this HF checkpoint (skips the shared SFT run)")
        sp.add_argument("--small", action="store_true",
                        help="prepend a toy-sized run (" + " ".join(SMALL) + ")")

    a = sub.add_parser("async", help="sync (max_lag=0) vs async (max_lag=1) on the same config and seeds")
    common(a)
    a.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    a.add_argument("--contention", action="store_true", help="also measure gen/train alone vs together")
    a.add_argument("--contention-s", type=float, default=20.0, help="seconds per contention phase")
    a.add_argument("--rollout", action="store_true", help="also run `bench rollout --models tiny`")
    a.add_argument("--modes", nargs="*", default=[], choices=sorted(QUALITY_MODES),
                   help="more modes per seed: auto (rollout.max_lag=auto), balance (max_lag=1 + trainer.auto_balance), "
                        "during (max_lag=1 + rollout.weight_update=during_generation)")
    a.add_argument("--eval-every", type=int, default=0,
                   help="evaluate every N steps (trainer.eval_every; inside each step's wall time, so the "
                        "speedup is then biased towards 1) and report each mode's wall time to the sync "
                        "run's final held-out pass@1 and its ratio to sync (the paper's time-to-quality)")
    s = sub.add_parser("sweep", help="the paper's N / T / K sweeps: final reward vs KL")
    common(s)
    s.add_argument("--algorithms", nargs="+", default=["online_dpo", "ppo", "rloo"])
    s.add_argument("--corrections", nargs="*", default=[], choices=["none", "tis", "icepop", "decoupled", "auto"],
                   help="trainer.off_policy_correction values, each a run of ppo / rloo / proximal_rloo / grpo "
                        "(online_dpo and best_of_k_sft take none and run once); default: the config's")
    s.add_argument("--seeds", type=int, nargs="*", default=[],
                   help="run.seed of every run (the outer loop); default: the config's seed")
    s.add_argument("--resume", action="store_true",
                   help="reuse the finished runs of --out-dir's sweep.json (same sizes) and run only the rest")
    s.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    s.add_argument("--t", type=int, nargs="+", default=[1, 2, 4])
    s.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    s.add_argument("--full", action="store_true",
                   help="use the config's steps/prompts instead of the sweep defaults (" + " ".join(SWEEP_DEFAULTS) + ")")
    s.add_argument("--max-lag", type=int, default=0,
                   help="0 (default): N is the only source of off-policyness, as in the paper's Figure 4")
    sub.add_parser("rollout", help="replica start-up, pool tokens/s, weight-sync seconds (bench/rollout.py; its own "
                                   "arguments follow)", add_help=False)
    sub.add_parser("learner", help="our learner step vs a plain PyTorch step of the same batch (bench/learner.py)",
                   add_help=False)
    sub.add_parser("checkpoint", help="a run checkpoint's cost to the learner, sync vs async, and its hashing "
                   "(bench/checkpoint.py)", add_help=False)
    sub.add_parser("lm-head", help="the LM head's logprobs alone, whole against chunked (bench/lm_head.py; "
                                   "chunk sizes in MB follow)", add_help=False)
    sub.add_parser("sync-profile", help="a replica's side of a weight sync, per phase and bucket, in this process "
                                        "(bench/sync_profile.py)", add_help=False)
    return p


# Subcommands that parse their own arguments and run in this process, imported only when asked for:
# bench.learner, bench.checkpoint and bench.lm_head import megatron-core, which async and sweep (they only start
# `megatron-async train` subprocesses) never need.
OWN_ARGUMENTS = {"rollout": "megatron_async.bench.rollout", "learner": "megatron_async.bench.learner",
                 "checkpoint": "megatron_async.bench.checkpoint",
                 "lm-head": "megatron_async.bench.lm_head", "sync-profile": "megatron_async.bench.sync_profile"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_ARGUMENTS:
        return importlib.import_module(OWN_ARGUMENTS[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.what == "sweep" and not args.full:
        args.overrides = [*SWEEP_DEFAULTS, *args.overrides]
    if args.small:
        args.overrides = [*SMALL, *args.overrides]
    args.out_dir = args.out_dir or f"runs/bench_{args.what}"
    try:
        return {"async": bench_async, "sweep": bench_sweep}[args.what](args)
    except ConfigError as e:
        print(f"megatron-async bench: config error: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"megatron-async bench: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
