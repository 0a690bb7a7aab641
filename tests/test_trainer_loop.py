"""The asynchronous loop (run/trainer.py), in-process: fakes for the learner, the rollout side (its
producer and pool) and the weight update, on a one-rank gloo group. No process starts.

Checked: the order of one step (take batch s, train, wait until the old weights' batches are
generated, push version s+1, notify the producer); a replica reported stale during a wait gets the
learner's current version before the wait ends; `trainer.max_bad_steps` stops the run with an
error; `close` closes every part even when one fails; `build` closes what it built when a later
part fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from megatron_async.config import load_config
from megatron_async.observability.tracking import NullTracker
from megatron_async.rollout.producer import RolloutBatch
from megatron_async.run import trainer as trainer_mod
from megatron_async.run.learner_state import LearnerState
from megatron_async.run.rank0 import Rank0
from megatron_async.run.report import StepReport
from megatron_async.run.rollout_state import RolloutState
from megatron_async.run.trainer import Trainer
from megatron_async.run_plan import build_plan
from megatron_async.weights.update import PushResult, WeightUpdate
from tests.batches import scored_batch


def config(tmp_path, *overrides):
    return load_config(None, [f"run.out_dir={tmp_path}", "trainer.steps=3", "trainer.eval_every=0",
                              "trainer.checkpoint_every=0", *overrides])


def batch(step: int, rewards=((1.0, 0.0),)) -> RolloutBatch:
    return scored_batch([list(r) for r in rewards], index=step, policy_version=max(0, step - 1))


@dataclass
class Events:
    log: list = field(default_factory=list)

    def __call__(self, *event):
        self.log.append(event)


class FakeProducer:
    """Has batch b as soon as it is asked about, except the first time (`first_wait`: the loop
    then waits once for batch 0)."""

    def __init__(self, events: Events, bad_rewards: bool = False, first_wait: bool = False):
        self.events, self.bad_rewards, self.first_wait = events, bad_rewards, first_wait
        self.synced = 0

    def has(self, step):
        waiting, self.first_wait = self.first_wait, False
        return not waiting

    def take(self, step):
        self.events("take", step)
        return batch(step, rewards=((None, None),) if self.bad_rewards else ((1.0, 0.0),))

    def old_weights_done(self, step):
        self.events("old_weights_done", step)
        return True

    def wait(self, timeout):
        pass

    def notify_synced(self, version):
        self.events("notify_synced", version)
        self.synced = version


class FakePool:
    urls = ["http://127.0.0.1:1"]

    def __init__(self, stale_once=()):
        self.stale_once = list(stale_once)
        self.replicas_up = True

    def up(self, replica_ids):
        return list(replica_ids) if self.replicas_up else []

    def replicas_needing_weights(self, wait_s=None):
        stale, self.stale_once = self.stale_once, []
        return [SimpleNamespace(replica_id=i) for i in stale]


class FakeRollout:
    def __init__(self, events: Events, producer: FakeProducer, pool: FakePool):
        self.events, self.producer, self.pool = events, producer, pool
        self.eval_prompts: list = []
        self.closed = False

    def start_producer(self, first_batch):
        self.events("start_producer", first_batch)

    def updates_per_batch(self):
        return 1

    def step_metrics(self):
        return {}

    def after_step(self, step, batch, metrics):
        pass

    def evaluate(self, tag, version, tracker):
        self.events("evaluate", tag, version)
        return 0.25 if tag.startswith("step") else None  # held out during the run (trainer.eval_every)

    def close(self):
        self.closed = True


class FakeLearner:
    def __init__(self, events: Events, skipped: bool = False):
        self.events, self.skipped, self.version = events, skipped, 0
        self.policy = SimpleNamespace(model=None)  # the HF export is replaced here; the push's stream is never iterated (FakeWeights)

    def step(self, batch, step, updates):
        self.events("train", step)
        self.version = step + 1
        return {"train/skipped": 1.0 if self.skipped else 0.0, "timing/train_s": 0.0}


class FakeWeights:
    def __init__(self, events: Events):
        self.events, self.closed = events, False

    def push(self, version, named_tensors, replica_ids=None):
        self.events("push", version, replica_ids)
        return PushResult(replicas=1)

    def close(self):
        self.closed = True


class FakeReport:
    def __init__(self):
        self.metrics = {}  # step -> what the loop recorded

    def record(self, step, batch, metrics):
        self.metrics[step] = metrics

    def finish(self, *args, **kwargs):
        pass


@pytest.fixture
def no_files(monkeypatch):
    """The checkpoint and the HF export are the learner's (tested with megatron elsewhere)."""
    saved = []

    class RecordedCheckpoints:  # run/checkpoint.py's RunCheckpoints: the steps saved
        def __init__(self, cfg, learner, ctrl, asynchronous):
            pass

        def save(self, next_step, rollout=None, report=None):
            saved.append(next_step)
            return Path(f"ckpt{next_step}")

        def poll(self):
            pass

        wait = close = poll

    monkeypatch.setattr(trainer_mod, "RunCheckpoints", RecordedCheckpoints)
    monkeypatch.setattr(trainer_mod, "export_hf", lambda *a, **k: None)
    monkeypatch.setattr(trainer_mod, "latest_checkpoint", lambda cfg: None)
    return saved


def make_trainer(tmp_path, ctrl, *overrides, stale_once=(), skipped=False, bad_rewards=False):
    events = Events()
    producer = FakeProducer(events, bad_rewards=bad_rewards, first_wait=bool(stale_once))
    rollout = FakeRollout(events, producer, FakePool(stale_once))
    # the fakes stand in for the records Trainer takes: it calls only what they have
    rank0 = Rank0(cast(RolloutState, rollout), cast(StepReport, FakeReport()), NullTracker())
    trainer = Trainer(config(tmp_path, *overrides), ctrl, cast(LearnerState, FakeLearner(events, skipped)), rank0,
                      NullTracker(), tmp_path, cast(WeightUpdate, FakeWeights(events)))
    return trainer, events


def test_each_step_takes_trains_waits_for_the_old_weights_pushes_then_notifies(tmp_path, one_rank_group, no_files):
    trainer, events = make_trainer(tmp_path, one_rank_group)
    trainer.train()
    loop = [e for e in events.log if e[0] != "evaluate"]
    expected: list[tuple] = [("start_producer", 0)]
    for s in range(3):
        expected += [("take", s), ("train", s), ("old_weights_done", s), ("push", s + 1, None), ("notify_synced", s + 1)]
    assert loop == expected
    assert [e for e in events.log if e[0] == "evaluate"] == [("evaluate", "before", 0), ("evaluate", "after", 3)]
    assert no_files == [3]  # the final checkpoint only (checkpoint_every=0)


def test_an_evaluation_during_the_run_is_recorded_with_the_step_whose_weights_it_evaluated(tmp_path, one_rank_group, no_files):
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=5", "trainer.eval_every=2")
    trainer.train()
    assert [e for e in events.log if e[0] == "evaluate"] == [("evaluate", "before", 0), ("evaluate", "step2", 2),
                                                             ("evaluate", "step4", 4), ("evaluate", "after", 5)]
    assert {s: m.get("eval/held_out") for s, m in trainer.rank0.report.metrics.items()} == {0: None, 1: 0.25, 2: None,
                                                                                           3: 0.25, 4: None}


def test_a_replica_reported_stale_during_a_wait_gets_the_current_version_first(tmp_path, one_rank_group, no_files):
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=1", stale_once=[1])
    trainer.train()
    loop = [e for e in events.log if e[0] not in ("evaluate", "start_producer")]
    # while the loop waits for batch 0, replica 1 is reported stale: it gets version 0 before the
    # wait ends (a wait that finds its condition met at once does not look at the pool)
    assert loop[:2] == [("push", 0, [1]), ("take", 0)]
    assert loop[2:] == [("train", 0), ("old_weights_done", 0), ("push", 1, None), ("notify_synced", 1)]


@pytest.mark.parametrize("bad", ["skipped", "no_reward"])
def test_max_bad_steps_in_a_row_stop_the_run_with_an_error_and_a_checkpoint(tmp_path, one_rank_group, no_files, bad):
    trainer, events = make_trainer(tmp_path, one_rank_group, "trainer.steps=5", "trainer.max_bad_steps=2",
                                   skipped=bad == "skipped", bad_rewards=bad == "no_reward")
    with pytest.raises(RuntimeError, match=r"2 consecutive learner steps .* \(steps 0..1; trainer.max_bad_steps=2\); stopping. "
                                           r"The last good weights are in ckpt2"):
        trainer.train()
    assert [e[1] for e in events.log if e[0] == "train"] == [0, 1] and no_files == [2]


def test_close_closes_every_part_even_when_one_fails(tmp_path, one_rank_group):
    trainer, _ = make_trainer(tmp_path, one_rank_group)
    tracker_closed = []
    trainer.tracker = SimpleNamespace(close=lambda: tracker_closed.append(True))

    def broken():
        raise OSError("sender already gone")

    trainer.weights.close = broken
    with pytest.raises(OSError, match="sender already gone"):
        trainer.close()
    assert trainer.rank0.rollout.closed and tracker_closed == [True]


def test_build_closes_what_it_built_when_a_later_part_fails(tmp_path, one_rank_group, monkeypatch):
    """The replicas started (RolloutState built), then the weight sender cannot be built: the
    rollout side and the tracker are closed before the error propagates."""
    closed = []
    layout = SimpleNamespace(rank=0, tp_rank=0, dp_rank=0, pp_rank=0)
    tracker = SimpleNamespace(resumed=True, close=lambda: closed.append("tracker"))
    rollout = SimpleNamespace(pool=SimpleNamespace(urls=["http://127.0.0.1:1"], key="k"),
                              close=lambda: closed.append("rollout"))
    monkeypatch.setattr(trainer_mod, "init_parallel", lambda *a, **k: layout)
    monkeypatch.setattr(trainer_mod, "prepare_base_model", lambda cfg: tmp_path)
    monkeypatch.setattr(trainer_mod, "load_tokenizer", lambda path: SimpleNamespace(pad_token_id=0))
    monkeypatch.setattr(trainer_mod, "build_tracker", lambda cfg, rank: tracker)
    monkeypatch.setattr(trainer_mod.LearnerState, "build", lambda *a: FakeLearner(Events()))
    monkeypatch.setattr(trainer_mod.RolloutState, "build", lambda *a: rollout)

    def no_sender(*a):
        raise ConnectionError("replica 0 refused the weight-transfer key")

    monkeypatch.setattr(trainer_mod, "build_weight_update", no_sender)
    with pytest.raises(ConnectionError, match="refused the weight-transfer key"):
        cfg = config(tmp_path, "sft.steps=0")
        Trainer.build(cfg, build_plan(cfg))
    assert closed == ["rollout", "tracker"]  # the reverse of the order they were built in
