"""CPU placement by default: parallel.learner_cpus / rollout.replica_cpus unset ("auto") split this
machine's CPUs between the learner ranks and the replicas (cluster/cpu_affinity.plan_cpus,
cluster/placement.cpu_plan); explicit keys win, "" means no pinning. Fast tier: no process starts."""
from __future__ import annotations

import os

import pytest

from megatron_async.cluster import placement
from megatron_async.cluster.cpu_affinity import CPUS_AUTO, parse_cpu_list, plan_cpus
from megatron_async.config import load_config
from megatron_async.run.preflight import preflight


def plan(learner=CPUS_AUTO, replica=CPUS_AUTO, *, cpus=(0, 1), cuda=False, ranks=1, here=True):
    return plan_cpus(learner, replica, cpus=list(cpus), cuda=cuda, learner_ranks=ranks, replicas_here=here)


def test_unset_keys_are_auto_and_distinct_from_no_pinning():
    assert load_config(None, []).parallel.learner_cpus == CPUS_AUTO
    assert load_config(None, []).rollout.replica_cpus == CPUS_AUTO
    cfg = load_config(None, ["parallel.learner_cpus=", "rollout.replica_cpus="])
    assert (cfg.parallel.learner_cpus, cfg.rollout.replica_cpus) == ("", "")


@pytest.mark.parametrize("cpus,ranks,learner,replica", [
    ((0, 1), 1, "0", "1"),  # the shipped CPU configs' split
    ((0, 1, 2), 1, "0", "1,2"),  # the odd CPU goes to the replicas
    (range(16), 1, "0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14,15"),
    ((0, 1, 2, 3), 3, "0,1,2", "3"),  # at least one CPU per local learner rank
    ((4, 6, 2, 5), 1, "2,4", "5,6"),  # the CPUs this process may use (taskset, cgroups), in order
])
def test_auto_splits_the_cpus_into_disjoint_sets(cpus, ranks, learner, replica):
    p = plan(cpus=cpus, ranks=ranks)
    assert (p.learner, p.replica) == (learner, replica)
    assert not set(parse_cpu_list(p.learner)) & set(parse_cpu_list(p.replica))
    assert set(parse_cpu_list(p.learner)) | set(parse_cpu_list(p.replica)) == set(cpus)


@pytest.mark.parametrize("kwargs,why", [
    (dict(cpus=(0,)), "1 CPU(s) cannot give 1 learner rank"),
    (dict(cpus=(0, 1), ranks=2), "2 CPU(s) cannot give 2 learner rank"),
    (dict(cuda=True), "CUDA"),
    (dict(here=False), "no replica runs on this node"),
])
def test_auto_leaves_both_unpinned_where_no_disjoint_split_helps(kwargs, why):
    p = plan(**kwargs)
    assert (p.learner, p.replica) == ("", "") and why in p.why


def test_explicit_keys_win_and_the_other_auto_key_takes_what_they_leave():
    assert (plan("1", "0").learner, plan("1", "0").replica) == ("1", "0")
    assert plan("1", "0").why == "set by the config"
    assert (plan("0", cpus=range(4)).learner, plan("0", cpus=range(4)).replica) == ("0", "1,2,3")
    assert (plan(CPUS_AUTO, "2-3", cpus=range(4)).learner, plan(CPUS_AUTO, "2-3", cpus=range(4)).replica) == ("0,1", "2-3")
    assert plan(0).learner == "0"  # YAML's `learner_cpus: 0` is an int


def test_no_pinning_asked_for_by_name_is_kept():
    p = plan("", "")
    assert (p.learner, p.replica, p.why) == ("", "", "set by the config")
    p = plan("")  # the learner unpinned on every CPU: none is left for the replicas alone
    assert (p.learner, p.replica) == ("", "") and "none" in p.why
    p = plan(CPUS_AUTO, "0-1")
    assert (p.learner, p.replica) == ("", "0-1")


def test_the_plan_is_one_log_line_naming_both_sides():
    line = plan().describe()
    assert "\n" not in line and "learner CPUs 0" in line and "replicas CPUs 1" in line
    assert "learner unpinned, replicas unpinned" in plan(cuda=True).describe()


def test_cpu_plan_of_a_config_sees_the_node_and_the_replicas(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(placement, "_gpus", lambda: 0)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    p = placement.cpu_plan(load_config(None, []))
    assert (p.learner, p.replica) == ("0", "1")
    away = load_config(None, ["rollout.replica_urls=[http://10.0.0.2:8000]", "rollout.token=t"])
    assert placement.cpu_plan(away).learner == ""  # replicas elsewhere: the learner keeps every CPU
    monkeypatch.setenv("GROUP_RANK", "1")  # the second node of two runs no replica
    assert placement.cpu_plan(load_config(None, ["placement.nnodes=2"])).learner == ""
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two learner ranks and a replica do not fit on 2 CPUs
    assert placement.cpu_plan(load_config(None, ["parallel.tp=2"])).learner == ""
    monkeypatch.setattr(placement, "_gpus", lambda: 8)
    assert placement.cpu_plan(load_config(None, [])).replica == ""


def test_preflight_accepts_auto_whatever_the_machine():
    preflight(load_config(None, []))  # an explicit bad list still fails: tests/test_bench.py
