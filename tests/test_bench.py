"""Bench report arithmetic (speedup / ideal / efficiency from given per-step timings) and the
validation of the CPU pinning keys. Fast, no processes, no timed assertions."""
import os

import pytest

from megatron_async.bench import report
from megatron_async.bench.commands import pin_overrides, sweep_plan
from megatron_async.config import ConfigError, load_config
from megatron_async.run.preflight import preflight
from megatron_async.cluster.cpu_affinity import format_cpu_list, parse_cpu_list, rank_cpus, replica_pin_env


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
    assert parse_cpu_list(0) == [0]
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
    assert load_config(None, []).parallel.learner_cpus == ""


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
    assert pin_overrides("none") == []
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
