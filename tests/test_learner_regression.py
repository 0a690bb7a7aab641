"""The learner's step gives the same numbers after a speed change: recorded values, same seed.

`tests/dist/learner_steps_worker.py` makes three steps of a tiny model of the main job's shape on
fixed synthetic batches, one rank, one thread. First recorded at c8038ad (before the
learner-throughput work of docs/performance.md: the staleness monitor taken from the training
forward, SDPA attention), with the tokenizer trained on the main job's SFT data; 52ee700's new data
changed that vocabulary (793 -> 713 tokens), so the model's size and the batches' ids, and the test
failed on an unchanged learner. The worker now trains its tokenizer on the fixed
`models/tiny.default_corpus`; the values below were recorded with it at d06a727 and are bitwise
what a37dd73, whose CI passed the c8038ad values, gives with the same worker. A change to the
learner's hot path must keep them to float tolerance (summation order may differ: rel 1e-4; the KL
to the reference, a mean of small differences of logprobs, to 5e-6 absolute: the attention
kernel's rounding moves it by ~6e-7).

RLOO's values were re-recorded when the KL in its reward moved from the generator's logprobs to the
learner's (algorithms/rloo.py): the batches' synthetic generator logprobs are 4.4 nats a token from
the learner's (`staleness/kl_k3_mean`), and that gap had been in the reward (grad norm 0.91, now
0.076). The other algorithms' values are unchanged.
"""
from __future__ import annotations

import json

import pytest

from tests.dist import run_worker

ABS_TOL = {"kl/ref": 5e-6}
RECORDED = {
    "online_dpo": [
        {"train/loss": 7.672385215759277, "train/grad_norm": 4.5514230954959425, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.44042444229126, "staleness/iw_max": 0.028923694044351578},
        {"train/loss": 7.663258075714111, "train/grad_norm": 5.018086907654007, "kl/ref": -0.0021206140518188477,
         "staleness/kl_k3_mean": 4.403609275817871, "staleness/iw_max": 0.030998583883047104},
        {"train/loss": 7.643415927886963, "train/grad_norm": 4.505409803644869, "kl/ref": 0.024230793118476868,
         "staleness/kl_k3_mean": 4.391524314880371, "staleness/iw_max": 0.02813786454498768}],
    "grpo": [
        {"train/loss": -0.0003890878870151937, "train/grad_norm": 0.00508094620969187, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.424890041351318, "staleness/iw_max": 0.028923694044351578},
        {"train/loss": -0.00022569068823941052, "train/grad_norm": 0.0054260719745726025, "kl/ref": 0.01308024674654007,
         "staleness/kl_k3_mean": 4.410757541656494, "staleness/iw_max": 0.03134194761514664},
        {"train/loss": 0.0001421858905814588, "train/grad_norm": 0.005096532448115798, "kl/ref": 0.008828848600387573,
         "staleness/kl_k3_mean": 4.420482158660889, "staleness/iw_max": 0.03237510472536087}],
    "rloo": [  # re-recorded at the KL-in-the-reward change (module docstring)
        {"train/loss": 0.041699089109897614, "train/grad_norm": 0.07636635053034527, "kl/ref": 0.0,
         "staleness/kl_k3_mean": 4.424890041351318, "staleness/iw_max": 0.028923694044351578},
        {"train/loss": 0.023815959692001343, "train/grad_norm": 0.08212783214034541, "kl/ref": 0.010979220271110535,
         "staleness/kl_k3_mean": 4.410816192626953, "staleness/iw_max": 0.031377509236335754},
        {"train/loss": -0.017813540995121002, "train/grad_norm": 0.07745935765962349, "kl/ref": 0.011628367006778717,
         "staleness/kl_k3_mean": 4.420403957366943, "staleness/iw_max": 0.032297130674123764}],
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
    with the grouping (measured with the c8038ad model: DPO's step-0 gradient norm 4.6214 against 4.6264 by rows)."""
    out = run_worker("learner_steps_worker.py", algorithm, tmp_path, "trainer.micro_batch_tokens=100000")
    steps = json.loads(next(line for line in out.splitlines() if line.startswith("STEPS "))[len("STEPS "):])
    for step, (got, want) in enumerate(zip(steps, RECORDED[algorithm], strict=True)):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=ABS_TOL.get(key, 1e-8)), f"step {step} {key}"
