"""HF <-> Megatron conversion (learner/convert.py over learner/mapping.py) and learner checkpoints."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.learner import convert
from megatron_async.learner.model import read_arch
from megatron_async.learner.mapping import expected_hf_shapes, validate_hf_checkpoint
from tests.dist import REPO, run_worker


@pytest.mark.integration  # torchrun (hf-to-megatron) and the converter as a subprocess
def test_hf_to_megatron_tp2pp2_to_hf_is_bit_exact(tiny_ckpts, tmp_path):
    """Qwen2 tiny (q/k/v bias, untied lm_head) through a TP2 x PP2 checkpoint and back at TP1."""
    src = tiny_ckpts["qwen2"]
    ckpt, back = tmp_path / "megatron", tmp_path / "hf"
    assert convert.main(["hf-to-megatron", str(src), str(ckpt), "--tp", "2", "--pp", "2"]) == 0  # launches torchrun
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["saved_with"] == {"tp": 2, "pp": 2, "dp": 1}
    assert not (tmp_path / "megatron.tmp").exists()
    subprocess.run([sys.executable, "-m", "megatron_async.learner.convert", "megatron-to-hf", str(ckpt), str(back)],
                   cwd=REPO, check=True, capture_output=True, timeout=180)

    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert read_arch(back) == read_arch(src)
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()

    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)


@pytest.mark.integration  # torchrun workers
@pytest.mark.parametrize("dtype,save_tp", [("float32", 2), ("bfloat16", 1)])
def test_checkpoint_resume(tiny_ckpts, tmp_path, dtype, save_tp):
    """Model + Adam + LR schedule saved and resumed at TP=1 take the same next step: fp32 saved at
    TP=2 (another layout); bf16 at TP=1, bit-exactly, its fp32 main weights (megatron's
    mixed-precision optimizer) restored as saved, not re-derived from the bf16 params, which
    would round them. A corrupted file, another architecture, a missing checkpoint and an optimizer
of the other dtype are refused clearly."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    run_worker("checkpoint_worker.py", "save", ckpt, out, tiny_ckpts["gqa"], "--tp", save_tp, "--dtype", dtype,
               nproc=save_tp)
    run_worker("checkpoint_worker.py", "resume", ckpt, out, tiny_ckpts["gqa"], tiny_ckpts["tied"], "--dtype", dtype)
    saved, resumed = torch.load(out / "save.pt"), torch.load(out / "resume.pt")
    assert resumed["metrics"]["lr"] == saved["metrics"]["lr"] == pytest.approx(5e-4)  # warmup step 2 of 2
    if dtype == "bfloat16":  # the same layout and kernels: the same step, to the bit
        assert resumed["main_weights"] > 0 and resumed["main_weights_restored"] is True
        assert resumed["metrics"]["loss"] == saved["metrics"]["loss"]
        assert saved["weights"].keys() == resumed["weights"].keys()
        for k, w in saved["weights"].items():
            assert w.dtype == torch.bfloat16 and torch.equal(resumed["weights"][k], w), k
    else:
        assert resumed["main_weights"] == 0 and resumed["main_weights_restored"] is None  # saved at TP=2
        assert resumed["metrics"]["loss"] == pytest.approx(saved["metrics"]["loss"], abs=1e-5)
        for k, w in saved["weights"].items():
            assert (resumed["weights"][k] - w).abs().max() < 1e-5, k
    errors = json.loads((out / "errors.json").read_text())
    assert errors["extra"] == {"step": 1}
    assert "is corrupt" in errors["corrupt"] and ".distcp" in errors["corrupt"]
    assert "tie_word_embeddings: checkpoint False vs model True" in errors["other_arch"]
    assert "manifest.json is missing" in errors["missing"]
    other = {"float32": "bfloat16", "bfloat16": "float32"}[dtype]
    assert f"was trained in {dtype}, this learner is {other}: resume with model.dtype={dtype}" in errors["other_dtype"]


def test_validation_names_the_tensor(tiny_ckpts, tmp_path):
    src = tiny_ckpts["gqa"]
    arch = read_arch(src)
    state = load_file(str(src / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_hf_shapes(arch)
    validate_hf_checkpoint(src)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1]
    del state["model.layers.0.self_attn.k_proj.weight"]
    state["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        validate_hf_checkpoint(bad)
    msg = str(e.value)
    assert "missing tensor model.layers.0.self_attn.k_proj.weight (expected shape [32, 64])" in msg
    assert "model.layers.1.mlp.up_proj.weight in model.safetensors has shape [95, 64], the config implies [96, 64]" in msg
    assert "unexpected tensor model.layers.0.extra.weight" in msg


def test_unsupported_configs_are_refused(tiny_ckpts):
    cfg = json.loads((tiny_ckpts["gqa"] / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        read_arch({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        read_arch({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ValueError, match=r"tp=3 must divide num_attention_heads \(4\)"):
        read_arch(cfg).check_parallel(3, 1)
