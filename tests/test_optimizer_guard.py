"""The NaN/inf gradient guard of `learner.optimizer.train_step`, on the real megatron learner (CPU, gloo).

megatron's fp32/bf16 optimizers step on non-finite gradients; the guard must catch a finite loss
with an inf or NaN gradient, also when only one tensor-parallel rank sees it, and leave weights,
Adam state and the LR schedule bit-identical. The logged grad_norm must be the real norm (the old
guard read megatron's norm before `step()`, where it is always 0.0). Run in fp32 (the CPU default) and
in bf16 (model.dtype: bfloat16), where megatron's mixed-precision optimizer steps fp32 main weights,
as on a GPU: the guard must also leave those untouched.
"""
from __future__ import annotations

import json
import math

import pytest

from tests.dist import run_worker

pytestmark = pytest.mark.integration  # torchrun workers (tests/conftest.py tiers)


def _nan(x) -> bool:
    return isinstance(x, str) and x == "nan" or isinstance(x, float) and math.isnan(x)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ranks(request, tiny_ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"guard_{request.param}")
    run_worker("optimizer_guard_worker.py", out, tiny_ckpts["gqa"], "--tp", 2, "--dtype", request.param, nproc=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_params_dtype_picks_megatrons_optimizer(ranks):
    for r in ranks:
        p = r["precision"]
        assert p["adam_state_dtypes"] == p["stepped_dtypes"] == ["torch.float32"]  # Adam is fp32 either way
        if p["param_dtypes"] == ["torch.bfloat16"]:  # the GPU's path: bf16 params, fp32 main weights
            assert p["optimizer"] == ["Float16OptimizerWithFloat16Params"]
            assert p["main_weight_dtypes"] == ["torch.float32"]
        else:
            assert p["param_dtypes"] == ["torch.float32"] and p["optimizer"] == ["FP32Optimizer"]
            assert p["main_weight_dtypes"] == []


def test_normal_step_logs_the_real_grad_norm(ranks):
    for r in ranks:
        m = r["normal"]
        assert m["skipped"] == 0.0 and math.isfinite(m["loss"])
        assert m["grad_norm"] > 0.0
        assert m["grad_norm"] == pytest.approx(r["main_grad_norm"], rel=1e-5)
        assert r["adam_state_entries"] > 0  # the step created Adam state, so "untouched" below means something
    assert ranks[0]["normal"]["grad_norm"] == ranks[1]["normal"]["grad_norm"]


def test_nonfinite_gradient_with_finite_loss_skips_on_every_rank(ranks):
    # the inf went into tensor-parallel rank 0's shard only: rank 1's own gradients were finite,
    # and it must skip too (the decision is all-reduced), or the two shards would diverge
    assert ranks[0]["tp_rank"] == 0 and not ranks[0]["inf_one_rank_local_finite"]
    assert ranks[1]["tp_rank"] == 1 and ranks[1]["inf_one_rank_local_finite"]
    for r in ranks:
        for case in ("inf_one_rank", "nan_grad"):
            m = r[case]
            assert math.isfinite(m["loss"]), f"{case}: the loss must stay finite for this test to mean anything"
            assert m["skipped"] == 1.0, f"rank {r['rank']} stepped on a non-finite gradient ({case})"
            assert _nan(m["grad_norm"])
        assert r["nan_loss"]["skipped"] == 1.0


def test_skipped_steps_leave_weights_optimizer_and_schedule_untouched(ranks):
    for r in ranks:
        assert r["untouched"] == {"weights": True, "adam_state": True, "main_weights": True, "schedule": True}, \
            r["untouched"]
        assert r["schedule_after_skips"]["num_steps"] == r["schedule_before"]["num_steps"] == 1
        # and training goes on afterwards: the next good step moves the weights and the schedule
        assert r["normal_again"]["skipped"] == 0.0 and r["normal_again"]["grad_norm"] > 0.0
        assert r["moved_after"]
        assert r["main_weights_moved_after"] == (r["precision"]["main_weight_dtypes"] == ["torch.float32"])
        assert r["schedule_final"]["num_steps"] == 2
        assert r["schedule_final"]["lr"] < r["schedule_before"]["lr"]  # linear decay advanced
