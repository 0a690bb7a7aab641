"""The trainer's Online DPO batches and loss on the real megatron-core learner."""
import json

from tests.dist import run_worker


def test_dpo_steps_on_a_fixed_batch_lower_its_loss(tiny_ckpts, tmp_path):
    out = tmp_path / "history.json"
    run_worker("dpo_descent_worker.py", tiny_ckpts["gqa"], out)
    history = json.loads(out.read_text())
    losses = [h["loss"] for h in history]
    assert abs(losses[0] - 0.6931) < 1e-3  # policy == reference at the first step: loss ln 2
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # each step lowers it
    assert history[-1]["rewards/margin"] > 0 and history[-1]["rewards/accuracy"] > 0.5
    assert all(h["skipped"] == 0.0 for h in history)
