"""The learner's step gives the same numbers after a speed change: recorded values, same seed.

The values below were recorded at commit c8038ad (before the learner-throughput work of
docs/performance.md: the staleness monitor taken from the training forward, SDPA attention) by
`tests/dist/learner_steps_worker.py`: three steps of the main job's tiny model on fixed synthetic
batches, one rank, one thread. A change to the learner's hot path must keep them to float
tolerance (summation order may differ: rel 1e-4; the KL to the reference, a mean of small
differences of logprobs, to 5e-6 absolute: the attention kernel's rounding moves it by ~6e-7).
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker

ABS_TOL = {"kl/ref": 5e-6}
RECORDED = {
    "online_dpo": [
        {"train/loss": 7.444176197052002, "train/grad_norm": 4.626443792209691, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.221343994140625, "staleness/iw_max": 0.04432108998298645},
        {"train/loss": 7.4468994140625, "train/grad_norm": 4.523977823879351, "kl/ref": 0.0013949573040008545,
         "staleness/kl_k3_mean": 4.1827073097229, "staleness/iw_max": 0.03493504598736763},
        {"train/loss": 7.454514503479004, "train/grad_norm": 4.352459416164653, "kl/ref": -0.009606480598449707,
         "staleness/kl_k3_mean": 4.283165454864502, "staleness/iw_max": 0.033780768513679504}],
    "grpo": [
        {"train/loss": -8.686473302077502e-05, "train/grad_norm": 0.00659917985312763, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.220154285430908, "staleness/iw_max": 0.04432108998298645},
        {"train/loss": -2.0618943381123245e-05, "train/grad_norm": 0.006220637369594348, "kl/ref": -0.0027326345443725586,
         "staleness/kl_k3_mean": 4.2029829025268555, "staleness/iw_max": 0.03590558096766472},
        {"train/loss": 4.8254732973873615e-05, "train/grad_norm": 0.00555436263787195, "kl/ref": -0.033343978226184845,
         "staleness/kl_k3_mean": 4.239414215087891, "staleness/iw_max": 0.03591640293598175}],
    "rloo": [
        {"train/loss": -1.0457441806793213, "train/grad_norm": 1.0034657859082512, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.220154285430908, "staleness/iw_max": 0.04432108998298645},
        {"train/loss": -1.3520848751068115, "train/grad_norm": 1.3617682600623202, "kl/ref": -0.0033937692642211914,
         "staleness/kl_k3_mean": 4.203003883361816, "staleness/iw_max": 0.03657623752951622},
        {"train/loss": -1.397900104522705, "train/grad_norm": 1.047903324494766, "kl/ref": 0.021121717989444733,
         "staleness/kl_k3_mean": 4.237917900085449, "staleness/iw_max": 0.03523826226592064}],
}


@pytest.mark.integration  # a megatron-core learner process
# chunked: 1 MB of logits (32 positions of 8 rows x 1024 words in fp32) at a time, recomputed in
# the backward (learner/lm_head.py), against the recorded whole logits
@pytest.mark.parametrize("overrides", [[], ["trainer.logits_chunk_mb=1"]], ids=["whole-logits", "chunked-logits"])
@pytest.mark.parametrize("algorithm", sorted(RECORDED))
def test_learner_steps_match_the_recorded_values(algorithm, overrides, tmp_path):
    out = run_worker("learner_steps_worker.py", algorithm, tmp_path, *overrides)
    steps = json.loads(next(line for line in out.splitlines() if line.startswith("STEPS "))[len("STEPS "):])
    assert len(steps) == len(RECORDED[algorithm])
    for step, (got, want) in enumerate(zip(steps, RECORDED[algorithm])):
        assert set(got) == set(want), f"step {step}: metrics {sorted(got)} vs recorded {sorted(want)}"
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=ABS_TOL.get(key, 1e-8)), f"step {step} {key}"


@pytest.mark.integration  # a megatron-core learner process
@pytest.mark.parametrize("algorithm", ["rloo"])
def test_token_budget_microbatches_match_the_recorded_values(algorithm, tmp_path):
    """trainer.micro_batch_tokens: the rows sorted longest first, 8 to a microbatch (the budget is
    never reached), each padded to its own longest row: other shapes, rows in another order, the same
    numbers. Row-mean losses only: GRPO's token aggregation and the main job's RPO term (Online DPO's
    token-mean NLL of the chosen) weigh tokens per microbatch (algorithms/base.py), so they move
    with the grouping (measured: DPO's step-0 gradient norm 4.6214 against the recorded 4.6264)."""
    out = run_worker("learner_steps_worker.py", algorithm, tmp_path, "trainer.micro_batch_tokens=100000")
    steps = json.loads(next(line for line in out.splitlines() if line.startswith("STEPS "))[len("STEPS "):])
    for step, (got, want) in enumerate(zip(steps, RECORDED[algorithm], strict=True)):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=ABS_TOL.get(key, 1e-8)), f"step {step} {key}"
