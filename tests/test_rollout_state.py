"""Rank 0's rollout state in a run checkpoint, in-process: `RolloutState.state_dict()` through JSON
into a freshly built state (as `--resume` builds it) gives back the rollout buffer, the prompt
position and the controllers of rollout.max_lag: auto and trainer.auto_balance (the lag, T and K
in force, not the config's starting values). End to end: tests/test_adaptive_e2e.py."""
import json
from dataclasses import replace

import pytest

from megatron_async.config import load_config
from megatron_async.data import PromptIterator, TokenizedPrompt
from megatron_async.data.problem import Problem
from megatron_async.rollout.producer import RolloutBatch, RolloutProducer, batch_from_json
from megatron_async.observability.tracking import NullTracker
from megatron_async.run.report import StepReport, batch_metrics
from megatron_async.run.rollout_state import RolloutState, build_controllers
from megatron_async.sample import Sample
from tests.batches import scored_batch

AUTO = ["rollout.max_lag=auto", "rollout.lag_cap=3", "trainer.auto_balance=true", "trainer.max_updates_per_batch=3",
        "rollout.k=2", "rollout.max_k=4", "rollout.prompts_per_step=2", "trainer.steps=10"]
WAITED = {"staleness/kl_k3_mean": 0.0, "timing/learner_idle_s": 1.0, "timing/step_wall_s": 2.0}  # raises lag and T
PROMPTS = [TokenizedPrompt(Problem(id=f"p{i}", question=f"q{i}", solution=str(i), answer=str(i)), f"q{i}", [5, i])
           for i in range(7)]


def json_round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state))  # what rollout_state.json holds


def test_the_controllers_state_round_trips():
    cfg = load_config(None, AUTO)
    lag, balance = build_controllers(cfg)
    assert lag is not None and balance is not None  # rollout.max_lag: auto, trainer.auto_balance: true
    assert lag.update(kl=0.0, learner_wait_s=1.0, step_s=2.0) and lag.lag == 2
    assert balance.update(learner_wait_s=1.0, replica_wait_s=0.0, step_s=2.0)  # T 1 -> 2
    assert balance.update(learner_wait_s=1.0, replica_wait_s=0.0, step_s=2.0)  # T 2 -> 3, its bound
    assert balance.update(learner_wait_s=0.0, replica_wait_s=1.0, step_s=2.0)  # K 2 -> 3
    resumed_lag, resumed_balance = build_controllers(cfg)
    assert resumed_lag is not None and resumed_balance is not None
    assert (resumed_lag.lag, resumed_balance.updates, resumed_balance.k) == (1, 1, 2)  # the config's start
    resumed_lag.load_state_dict(json_round_trip(lag.state_dict()))
    resumed_balance.load_state_dict(json_round_trip(balance.state_dict()))
    assert (resumed_lag.lag, resumed_balance.updates, resumed_balance.k) == (2, 3, 3)
    # and they go on as the uninterrupted ones do: T is at its bound, so a generation-bound step moves nothing
    assert not resumed_balance.update(learner_wait_s=1.0, replica_wait_s=0.0, step_s=2.0)
    assert resumed_lag.update(kl=0.0, learner_wait_s=1.0, step_s=2.0) == lag.update(kl=0.0, learner_wait_s=1.0, step_s=2.0)
    assert resumed_lag.lag == lag.lag == 3


def batch(index: int, prompts: list[TokenizedPrompt], k: int, data_state: dict) -> RolloutBatch:
    samples = [Sample(prompt_index=i, prompt_token_ids=tuple(p.ids), token_ids=(3, 4), logprobs=(-0.5, -0.25),
                      reward=[1.0, None][j], policy_version=index, sample_index=j, replica_id=0, policy_version_max=index)
               for i, p in enumerate(prompts) for j in range(k)]
    return RolloutBatch(index=index, policy_version=index, problems=[p.problem for p in prompts], samples=samples,
                        data_state=data_state)


def rollout_state(cfg) -> RolloutState:
    """RolloutState.build without replicas or a scorer (neither holds resume state)."""
    prompts = PromptIterator(PROMPTS, seed=cfg.run.seed)
    adaptive_lag, balance = build_controllers(cfg)
    return RolloutState(cfg, tokenizer=None, prompts=prompts, eval_prompts=[],
                        scorer=None, pool=None,  # type: ignore[arg-type]  # deliberately none: no resume state
                        data_state=prompts.state_dict(), adaptive_lag=adaptive_lag, balance=balance)


def test_a_resumed_rollout_state_has_the_buffer_the_prompt_position_and_the_controllers():
    cfg = load_config(None, AUTO)
    run = rollout_state(cfg)
    trained = batch(0, run.prompts.take(2), 2, run.prompts.state_dict())
    buffered = batch(1, run.prompts.take(2), 2, run.prompts.state_dict())
    run.producer = RolloutProducer(make_batch=None,  # type: ignore[arg-type]  # never called: nothing generated
                                   max_lag=1, last_batch=cfg.trainer.steps - 1, first_batch=1, ready=[buffered])  # as after step 0: batch 1 generated, not started here
    run.after_step(0, trained, dict(WAITED))  # the learner waited: the lag and T rise
    assert (run.producer.max_lag, run.updates_per_batch(), run.k()) == (2, 2, 2)
    in_flight = run.prompts.take(2)  # batch 2 was being generated at the checkpoint: not saved
    state = json_round_trip(run.state_dict())

    resumed = rollout_state(cfg)
    assert resumed.adaptive_lag is not None
    assert (resumed.adaptive_lag.lag, resumed.updates_per_batch()) == (1, 1)
    resumed.load_state_dict(state)
    assert resumed.resumed_buffer == [buffered]
    assert resumed.prompts.take(2) == in_flight  # batch 2 is generated again from the same prompts
    assert (resumed.adaptive_lag.lag, resumed.updates_per_batch(), resumed.k()) == (2, 2, 2)


def test_a_controller_the_resumed_config_turns_off_stays_off_and_one_it_turns_on_starts_fresh():
    cfg = load_config(None, AUTO)
    run = rollout_state(cfg)
    run.producer = RolloutProducer(make_batch=None,  # type: ignore[arg-type]  # never called: nothing generated
                                   max_lag=1, last_batch=cfg.trainer.steps - 1)
    run.after_step(0, batch(0, run.prompts.take(2), 2, run.prompts.state_dict()), dict(WAITED))
    fixed = rollout_state(load_config(None, ["rollout.max_lag=1", "rollout.k=2", "rollout.prompts_per_step=2"]))
    fixed.load_state_dict(json_round_trip(run.state_dict()))
    assert (fixed.adaptive_lag, fixed.balance, fixed.updates_per_batch()) == (None, None, 1)

    run_fixed = rollout_state(load_config(None, ["rollout.max_lag=1", "rollout.k=2", "rollout.prompts_per_step=2"]))
    run_fixed.producer = RolloutProducer(make_batch=None,  # type: ignore[arg-type]  # never called: nothing generated
                                         max_lag=1, last_batch=cfg.trainer.steps - 1)
    auto = rollout_state(cfg)
    auto.load_state_dict(json_round_trip(run_fixed.state_dict()))
    assert auto.adaptive_lag is not None
    assert (auto.adaptive_lag.lag, auto.updates_per_batch(), auto.k()) == (1, 1, 2)


def test_the_step_report_history_round_trips(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    report = StepReport(cfg, tracker=NullTracker(), history=[{"step": 0, "reward/mean": 0.5}])
    resumed = StepReport(cfg, tracker=NullTracker())
    resumed.load_state_dict(json_round_trip(report.state_dict()))
    assert resumed.history == report.history


def test_batch_metrics_count_every_sample_and_average_the_scored_ones():
    """A batch is one flat list of samples: the failed score (None) counts as a sample and its tokens,
    not as a reward; a sample whose tokens span two versions is counted."""
    b = scored_batch([[1.0, 0.0], [0.5, None]], policy_version=3)
    b.samples[1] = replace(b.samples[1], policy_version_max=4)  # updated during its generation
    m = batch_metrics(b)
    assert (m["rollout/prompts"], m["rollout/samples"], m["balance/k"]) == (2.0, 4.0, 2.0)
    assert m["reward/mean"] == 0.5 and m["rollout/multi_version_samples"] == 1.0
    assert [s.reward for s in b.scored()] == [1.0, 0.0, 0.5]


def test_a_buffer_saved_in_the_old_layout_is_refused_in_one_line():
    """Checkpoints saved before the one sample record held parallel lists: refused, not a KeyError."""
    with pytest.raises(ValueError, match="layout before the one sample record"):
        batch_from_json({"problems": [], "completions": [], "rewards": []})
