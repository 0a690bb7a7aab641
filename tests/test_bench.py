"""Bench report arithmetic (speedup / ideal / efficiency from given per-step timings) and the
validation of the CPU pinning keys. Fast, no processes, no timed assertions."""
import os
from pathlib import Path

import pytest
import torch

from megatron_async.bench import report
from megatron_async.bench.commands import pin_overrides, sweep_plan
from megatron_async.config import ConfigError, load_config
from megatron_async.run.preflight import preflight
from megatron_async.cluster.cpu_affinity import format_cpu_list, parse_cpu_list, rank_cpus, replica_pin_env

REPO = Path(__file__).resolve().parents[1]


def history(gen, train, sync, idle, wall, replica_idle_cumulative=None, reward=0.5, kl=0.1):
    rows = []
    for i, (g, t, s, d, w) in enumerate(zip(gen, train, sync, idle, wall)):
        h = {"step": i, "timing/generation_s": g, "timing/train_s": t, "timing/sync_s": s,
             "timing/learner_idle_s": d, "timing/step_wall_s": w, "reward/mean": reward + i, "kl/ref": kl * i}
        if replica_idle_cumulative is not None:
            h["rollout/replica_idle_s"] = replica_idle_cumulative[i]
        rows.append(h)
    return rows


def test_ideal_speedup_is_sum_over_max():
    assert report.ideal_speedup(2.0, 2.0) == 2.0
    assert report.ideal_speedup(3.0, 1.0) == pytest.approx(4.0 / 3.0)
    assert report.ideal_speedup(1.0, 3.0) == pytest.approx(4.0 / 3.0)
    with pytest.raises(ValueError):
        report.ideal_speedup(0.0, 0.0)


def test_ideal_with_serial_and_pipeline_fill():
    # g=2, t=2, sync 1: asymptotic (2+2+1)/(2+1)
    assert report.ideal_with_serial(2.0, 2.0, 1.0) == pytest.approx(5.0 / 3.0)
    # over 4 steps: sync 4*5=20; async 2 + 4*1 + 3*2 + 2 = 14
    assert report.ideal_with_serial(2.0, 2.0, 1.0, steps=4) == pytest.approx(20.0 / 14.0)


def test_per_step_timings_turns_cumulative_replica_idle_into_increments():
    h = history([1, 1, 1], [2, 2, 2], [0.1] * 3, [1, 0, 0], [3, 2, 2], replica_idle_cumulative=[0.0, 1.5, 2.0])
    rows = report.per_step_timings(h)
    assert [r["replica_idle_s"] for r in rows] == pytest.approx([0.0, 1.5, 0.5])
    assert [r["train_s"] for r in rows] == [2.0, 2.0, 2.0]


def test_learner_idle_includes_the_wait_before_the_weight_push():
    h = history([1, 1], [2, 2], [0.1] * 2, [1.0, 0.0], [3, 2])
    h[1]["timing/learner_wait_old_s"] = 0.75
    assert [r["learner_idle_s"] for r in report.per_step_timings(h)] == [1.0, 0.75]


def test_per_step_timings_names_a_missing_metric():
    h = history([1], [2], [0.1], [0], [3])
    del h[0]["timing/step_wall_s"]
    with pytest.raises(KeyError, match="timing/step_wall_s"):
        report.per_step_timings(h)


def test_mode_summary_wall_means_and_final_quality():
    h = history([1, 3], [2, 4], [0.5, 0.5], [1, 3], [3.5, 7.5])
    s = report.mode_summary(h, tail=1)
    assert s["wall_s"] == 11.0
    assert s["mean_generation_s"] == 2.0 and s["mean_train_s"] == 3.0
    assert s["final_reward"] == 1.5 and s["final_kl"] == pytest.approx(0.1)
    assert s["steps"] == 2


def test_speedup_report_from_given_timings():
    # sync: gen 2 + train 2 + sync 0.5 per step -> wall 4.5 / step; async overlaps: 2.5 / step
    sync = [report.mode_summary(history([2] * 4, [2] * 4, [0.5] * 4, [2] * 4, [4.5] * 4))] * 2
    asyn = [report.mode_summary(history([2] * 4, [2] * 4, [0.5] * 4, [0] * 4, [3.0] * 4)),
            report.mode_summary(history([2] * 4, [2] * 4, [0.5] * 4, [0] * 4, [2.0] * 4))]
    r = report.speedup_report(sync, asyn)
    assert r["speedup_per_seed"] == pytest.approx([1.5, 2.25])
    assert r["speedup"] == pytest.approx(36.0 / 20.0)  # total sync wall / total async wall
    assert r["ideal"] == pytest.approx(2.0)
    assert r["efficiency"] == pytest.approx(0.9)
    assert r["in_run_slowdown_generation"] == pytest.approx(1.0)


def test_speedup_report_refuses_unpaired_runs():
    s = report.mode_summary(history([1], [1], [0], [0], [2]))
    with pytest.raises(ValueError, match="same number"):
        report.speedup_report([s, s], [s])


def test_contention_fraction():
    assert report.contention(100.0, 92.0) == pytest.approx(0.08)
    with pytest.raises(ValueError):
        report.contention(0.0, 1.0)


# ----------------------------------------------------------------------------- pinning keys


def test_parse_cpu_list_forms():
    assert parse_cpu_list("") == []
    assert parse_cpu_list("1") == [1]
    assert parse_cpu_list(0) == [0]  # type: ignore[arg-type]  # deliberately an int: YAML reads `learner_cpus: 0` so
    assert parse_cpu_list("0,2-4") == [0, 2, 3, 4]
    assert format_cpu_list({3, 1}) == "1,3"
    for bad in ("a", "1-", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_rank_cpus_splits_evenly_or_shares():
    assert rank_cpus([0, 1, 2, 3], 1, 2) == [2, 3]
    assert rank_cpus([0], 1, 2) == [0]  # fewer CPUs than ranks: all ranks share them
    assert rank_cpus([4, 5], 0, 1) == [4, 5]


def test_replica_env_carries_the_cpu_list():
    env = replica_pin_env("1")
    assert env["MEGATRON_ASYNC_CPUS"] == "1" and env["OMP_NUM_THREADS"] == "1"


def test_config_accepts_pinning_keys():
    cfg = load_config(None, ["parallel.learner_cpus=0", "rollout.replica_cpus=0"])
    assert str(cfg.parallel.learner_cpus) == "0" and str(cfg.rollout.replica_cpus) == "0"
    assert load_config(None, []).parallel.learner_cpus == "auto"  # unset: tests/test_cpu_placement.py


@pytest.mark.parametrize("override,key", [
    ("parallel.learner_cpus=zero", "parallel.learner_cpus"),
    ("rollout.replica_cpus=2-1", "rollout.replica_cpus"),
    (f"rollout.replica_cpus={os.cpu_count()}", "rollout.replica_cpus"),  # one past the last CPU
    ("parallel.learner_cpus=[0]", "parallel.learner_cpus"),
])
def test_config_rejects_bad_pinning_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        preflight(load_config(None, [override]))


def test_pin_overrides():
    assert pin_overrides("none") == ["parallel.learner_cpus=", "rollout.replica_cpus="]  # "" = no pinning
    assert pin_overrides("auto") == []  # the config's keys: unset, the trainer's own split
    assert pin_overrides("0:1") == ["parallel.learner_cpus=0", "rollout.replica_cpus=1"]
    with pytest.raises(SystemExit):
        pin_overrides("0")


def test_sweep_plan_sweeps_n_for_each_algorithm_and_t_k_for_the_first():
    plan = sweep_plan(["online_dpo", "rloo"], [1, 2], [2], [8])
    assert [(p["algorithm"], p["knob"], p["value"]) for p in plan] == [
        ("online_dpo", "N", 1), ("online_dpo", "N", 2), ("rloo", "N", 1), ("rloo", "N", 2),
        ("online_dpo", "T", 2), ("online_dpo", "K", 8)]
    assert plan[-1]["overrides"] == ["rollout.k=8"]


def test_write_sweep_writes_csv_json_and_png_with_failed_rows(tmp_path):
    import csv
    import json

    from megatron_async.bench.commands import write_sweep

    rows = [{"algorithm": "ppo", "knob": "N", "value": 1, "status": "failed: train exited 1"},
            {"algorithm": "online_dpo", "knob": "N", "value": 1, "status": "ok", "final_reward": 0.1, "final_kl": 0.01},
            {"algorithm": "online_dpo", "knob": "N", "value": 2, "status": "ok", "final_reward": 0.2, "final_kl": 0.05},
            {"algorithm": "online_dpo", "knob": "T", "value": 1, "status": "ok", "final_reward": 0.1,
             "final_kl": 0.01, "same_run_as": "N=1"}]
    write_sweep(tmp_path, rows, {"max_lag": 0, "steps": 2, "prompts_per_step": 4})
    got = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [r["status"][:6] for r in got] == ["failed", "ok", "ok", "ok"]
    assert got[3]["same_run_as"] == "N=1"
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"][2]["final_kl"] == 0.05
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_plan_crosses_corrections_with_the_algorithms_that_take_one_and_puts_seeds_outermost():
    plan = sweep_plan(["online_dpo", "ppo", "grpo"], [1, 4], [], [], corrections=["none", "tis"], seeds=[0, 1])
    cells = [(p["seed"], p["algorithm"], p["correction"], p["value"]) for p in plan]
    assert len(plan) == 2 * (1 + 2 + 2) * 2  # seeds x (online_dpo once, ppo and grpo per correction) x N
    assert cells[:10] == [(0, "online_dpo", "n/a", 1), (0, "online_dpo", "n/a", 4),
                          (0, "ppo", "none", 1), (0, "ppo", "none", 4), (0, "ppo", "tis", 1), (0, "ppo", "tis", 4),
                          (0, "grpo", "none", 1), (0, "grpo", "none", 4), (0, "grpo", "tis", 1), (0, "grpo", "tis", 4)]
    assert {c[0] for c in cells[10:]} == {1}
    assert plan[0]["overrides"] == ["trainer.minibatches=1", "run.seed=0"]  # online_dpo: no correction key
    assert plan[4]["overrides"] == ["trainer.minibatches=1", "trainer.off_policy_correction=tis", "run.seed=0"]
    assert plan[4]["name"] == "ppo_N1_tis_seed0"
    assert len({p["name"] for p in plan}) == len(plan)  # every run has its own dir


def test_sweep_plan_runs_t_and_k_per_seed_with_the_first_algorithms_first_correction():
    plan = sweep_plan(["rloo"], [1], [2], [8], corrections=["tis", "none"], seeds=[3], corrected={"rloo"})
    assert [(p["knob"], p["value"], p["correction"]) for p in plan] == [
        ("N", 1, "tis"), ("N", 1, "none"), ("T", 2, "tis"), ("K", 8, "tis")]
    assert plan[-1]["overrides"] == ["rollout.k=8", "trainer.off_policy_correction=tis", "run.seed=3"]


def test_with_base_rows_adds_the_first_algorithms_n1_run_as_t1_and_k_per_seed():
    from megatron_async.bench.commands import with_base_rows

    rows = [{"algorithm": "ppo", "correction": "none", "seed": s, "knob": "N", "value": n, "status": "ok"}
            for s in (0, 1) for n in (1, 2)] + \
           [{"algorithm": "ppo", "correction": "tis", "seed": 0, "knob": "N", "value": 1, "status": "ok"}]
    extra = with_base_rows(rows, 8)[len(rows):]
    assert [(r["seed"], r["knob"], r["value"], r["same_run_as"]) for r in extra] == [
        (0, "T", 1, "N=1"), (0, "K", 8, "N=1"), (1, "T", 1, "N=1"), (1, "K", 8, "N=1")]


def sweep_rows():
    def run(algorithm, correction, seed, n, p1, reward, kl, status="ok"):
        return {"algorithm": algorithm, "correction": correction, "seed": seed, "knob": "N", "value": n,
                "status": status, "pass_at_1_before": 0.5, "pass_at_1_after": p1, "final_reward": reward,
                "final_kl": kl, "wall_s": 10.0}
    return [run("online_dpo", "n/a", 0, 1, 0.60, 0.40, 0.10), run("online_dpo", "n/a", 1, 1, 0.64, 0.44, 0.20),
            run("ppo", "none", 0, 1, 0.55, 0.30, 0.05), run("ppo", "none", 1, 1, None, None, None, "failed: x"),
            run("ppo", "tis", 0, 1, 0.50, 0.20, 0.02), run("ppo", "tis", 1, 1, 0.52, 0.30, 0.04),
            run("online_dpo", "n/a", 0, 2, 0.58, 0.35, 0.30), run("online_dpo", "n/a", 1, 2, 0.58, 0.37, 0.34)]


def test_aggregate_sweep_means_and_half_ranges_over_the_seeds_that_finished():
    from megatron_async.bench.commands import aggregate_sweep

    agg = {(r["algorithm"], r["correction"], r["value"]): r for r in aggregate_sweep(sweep_rows())}
    assert list(agg) == [("online_dpo", "n/a", 1), ("ppo", "none", 1), ("ppo", "tis", 1), ("online_dpo", "n/a", 2)]
    dpo = agg[("online_dpo", "n/a", 1)]
    assert dpo["seeds"] == [0, 1] and dpo["failed"] == 0
    assert dpo["pass_at_1_after"] == pytest.approx(0.62) and dpo["pass_at_1_after_spread"] == pytest.approx(0.02)
    assert dpo["final_kl"] == pytest.approx(0.15) and dpo["final_kl_spread"] == pytest.approx(0.05)
    ppo = agg[("ppo", "none", 1)]
    assert ppo["seeds"] == [0] and ppo["failed"] == 1 and ppo["status"] == "ok"
    assert ppo["final_reward"] == pytest.approx(0.30) and ppo["final_reward_spread"] == 0


def test_aggregate_sweep_of_only_failed_runs_keeps_the_failure():
    from megatron_async.bench.commands import aggregate_sweep

    (row,) = aggregate_sweep([{"algorithm": "grpo", "correction": "tis", "seed": 0, "knob": "N", "value": 8,
                               "status": "failed: train exited 1"}])
    assert row["status"].startswith("failed") and row["failed"] == 1 and row["pass_at_1_after"] is None


def test_sweep_table_shows_mean_plus_minus_half_range_and_failed_seeds():
    from megatron_async.bench.commands import aggregate_sweep, sweep_table

    lines = sweep_table(aggregate_sweep(sweep_rows())).splitlines()
    assert lines[0].startswith("| algorithm | correction | run | seeds | held-out pass@1 after")
    assert lines[2] == "| online_dpo | n/a | N=1 | 2 | 0.620 ± 0.020 | 0.420 ± 0.020 | 0.150 ± 0.050 |"
    assert lines[3] == "| ppo | none | N=1 | 1 (1 failed) | 0.550 | 0.300 | 0.050 |"  # one seed: no spread
    assert len(lines) == 2 + 4


def test_write_sweep_with_seeds_and_corrections_writes_the_table_and_figure4(tmp_path):
    import json

    from megatron_async.bench.commands import write_sweep

    write_sweep(tmp_path, sweep_rows(), {"max_lag": 0, "steps": 2, "prompts_per_step": 4, "k": 4, "eval_size": 256,
                                         "command": "megatron-async bench sweep x", "planned_runs": 8,
                                         "finished_runs": 8}, quiet=True)
    md = (tmp_path / "sweep.md").read_text()
    assert "256 held-out problems; 8 of 8 planned runs" in md and "pass@1 before 0.500-0.500" in md
    assert "| ppo | tis | N=1 | 2 | 0.510 ± 0.010 |" in md
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["rows"]) == 8 and len(data["aggregate"]) == 4
    for png in ("sweep.png", "figure4.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_resumable_rows_reuses_finished_runs_of_a_sweep_of_the_same_sizes(tmp_path):
    import json

    from megatron_async.bench.commands import BenchError, resumable_rows, sweep_key, with_base_rows

    meta = {"max_lag": 1, "steps": 10, "prompts_per_step": 32, "k": 4, "eval_size": 256}
    assert resumable_rows(tmp_path / "sweep.json", meta) == {}  # nothing to resume
    rows = with_base_rows(sweep_rows(), 4)  # + the online_dpo N=1 copies as T=1 / K=4
    (tmp_path / "sweep.json").write_text(json.dumps({**meta, "command": "x", "rows": rows}))
    got = resumable_rows(tmp_path / "sweep.json", meta)
    assert len(got) == 7 and ("ppo", "none", 1, "N", 1) not in got  # the failed run is rerun
    assert got[("ppo", "tis", 0, "N", 1)]["resumed"] and sweep_key(rows[4]) == ("ppo", "tis", 0, "N", 1)
    with pytest.raises(BenchError, match="steps 10 != 12"):
        resumable_rows(tmp_path / "sweep.json", {**meta, "steps": 12})


def test_bench_sweep_resume_runs_only_what_is_missing_and_keeps_earlier_runs(tmp_path, monkeypatch):
    import json

    from megatron_async.bench import commands

    ran = []

    def fake_run(config, overrides, out_dir, name, **kw):
        ran.append(name)
        hist = [{"step": i, "timing/generation_s": 1.0, "timing/train_s": 1.0, "timing/sync_s": 0.1,
                 "timing/learner_idle_s": 0.0, "timing/step_wall_s": 2.0, "reward/mean": 0.5, "kl/ref": 0.1}
                for i in range(2)]
        return {"history": hist, "pass_at_1_before": 0.5, "pass_at_1_after": 0.6, "eval_n": 256,
                "seconds_total": 5.0, "load_avg_before": [1.0, 1.0, 1.0]}

    monkeypatch.setattr(commands, "run_training", fake_run)
    for plot in ("plot_sweep", "plot_figure4"):  # drawn by test_write_sweep_*; here only the loop matters
        monkeypatch.setattr(report, plot, lambda *a, **k: None)
    argv = ["sweep", str(REPO / "configs" / "cpu_tiny.yaml"), "trainer.steps=2", "--algorithms", "online_dpo", "ppo",
            "--t", "1", "--k", "8", "--corrections", "none", "tis", "--seeds", "0", "--init-model", "tiny-sft",
            "--out-dir", str(tmp_path)]
    monkeypatch.setattr(commands, "prepare_sft", lambda *a, **k: [])
    assert commands.main([*argv, "--n", "1", "2"]) == 0
    assert ran == ["online_dpo_N1_seed0", "online_dpo_N2_seed0", "ppo_N1_none_seed0", "ppo_N2_none_seed0",
                   "ppo_N1_tis_seed0", "ppo_N2_tis_seed0"]
    ran.clear()
    assert commands.main([*argv, "--n", "1", "4", "--resume"]) == 0
    assert ran == ["online_dpo_N4_seed0", "ppo_N4_none_seed0", "ppo_N4_tis_seed0"]
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["reused_runs"] == 3 and data["kept_earlier_runs"] == 3 and len(data["commands"]) == 2
    ns = sorted((r["algorithm"], r["correction"], r["value"]) for r in data["rows"] if r["knob"] == "N")
    assert len(ns) == 9 and ("ppo", "tis", 2) in ns  # N=2 kept from the first invocation
    assert "| ppo | tis | N=4 | 1 | 0.600 |" in (tmp_path / "sweep.md").read_text()


def test_final_metric_averages_the_last_steps_that_logged_it():
    hist: list[dict] = [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}, {"step": 2}, {"step": 3, "x": 4.0}, {"step": 4, "x": 6.0}]
    assert report.final_metric(hist, "x") == pytest.approx(4.0)
    assert report.final_metric(hist, "y") is None


def test_sweep_parser_takes_corrections_and_seeds():
    from megatron_async.bench.commands import build_parser

    args = build_parser().parse_args(["sweep", "c.yaml", "--corrections", "none", "tis", "--seeds", "0", "1",
                                      "--resume"])
    assert args.corrections == ["none", "tis"] and args.seeds == [0, 1] and args.resume
    assert build_parser().parse_args(["sweep", "c.yaml"]).corrections == []


def test_time_to_quality_places_each_evaluation_at_its_steps_wall_time():
    from megatron_async.bench.commands import time_to_quality_report

    history = [{"step": s, "timing/step_wall_s": 2.0} for s in range(4)]
    curve = report.quality_curve(history, {2: 0.3, 4: 0.5})  # eval_step2.json, then eval_after.json
    assert curve == [(4.0, 0.3), (8.0, 0.5)]
    assert report.time_to_quality(curve, 0.3) == 4.0 and report.time_to_quality(curve, 0.6) is None
    runs = {"sync": {1: {"quality_curve": curve}},
            "async": {1: {"quality_curve": [(3.0, 0.4), (6.0, 0.55)]}},
            "auto": {1: {"quality_curve": [(3.0, 0.1), (6.0, 0.2)]}}}
    t = time_to_quality_report(runs, [1])
    assert t["sync"] == {"seconds": [8.0], "ratio_to_sync": [1.0]}
    assert t["async"] == {"seconds": [6.0], "ratio_to_sync": [0.75]}
    assert t["auto"] == {"seconds": [None], "ratio_to_sync": [None]}  # never reached sync's final


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to one and lift it")
def test_sft_before_the_replicas_gets_the_cpus_back_and_the_pinning_returns(monkeypatch):
    from megatron_async.cluster import cpu_affinity

    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    monkeypatch.setattr(cpu_affinity, "_ORIGINAL_AFFINITY", set(before))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    try:
        cpu_affinity.pin_current_process(before[:1])
        with cpu_affinity.unpinned_before_replicas():
            assert sorted(os.sched_getaffinity(0)) == before and torch.get_num_threads() == len(before)
        assert sorted(os.sched_getaffinity(0)) == before[:1] and torch.get_num_threads() == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # several local ranks: each keeps its share
        with cpu_affinity.unpinned_before_replicas():
            assert sorted(os.sched_getaffinity(0)) == before[:1]
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


class _NoMegatron:
    """A meta-path finder that refuses megatron-core, as a machine without it would."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"{name} is hidden by the test")
        return None


def test_bench_commands_import_without_megatron(monkeypatch):
    """`bench async` / `sweep` / `rollout` start subprocesses or replicas: their module loads without
    megatron-core (only `bench learner` imports it, when asked). Every megatron and megatron_async
    module is dropped from sys.modules first, so nothing imported earlier hides an import."""
    import importlib
    import sys

    for name in [k for k in sys.modules if k.split(".")[0] in ("megatron", "megatron_async")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    monkeypatch.setattr(sys, "meta_path", [_NoMegatron(), *sys.meta_path])
    commands = importlib.import_module("megatron_async.bench.commands")
    assert callable(commands.main) and callable(importlib.import_module(commands.OWN_ARGUMENTS["rollout"]).main)
    assert not [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]
    for needs_megatron in ("learner", "lm-head"):  # the finder does hide it: these two need megatron-core
        with pytest.raises(ImportError, match="hidden by the test"):
            importlib.import_module(commands.OWN_ARGUMENTS[needs_megatron])
