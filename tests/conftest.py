"""Shared fixtures: tiny HF checkpoints built in code (learner, conversion tests)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF checkpoints sharing one tokenizer: GQA (untied), tied embeddings, llama3 rope
    scaling, and a Qwen2 (q/k/v bias). Hidden 64, 2 layers, 4 heads / 2 KV groups, vocab 320."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from megatron_async.models.tiny import TinyLlamaSpec, build_tiny_llama, build_tokenizer, default_corpus

    root = tmp_path_factory.mktemp("tiny_ckpts")
    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    out = {
        "gqa": build_tiny_llama(root / "gqa", tok, TinyLlamaSpec(**small), seed=1),
        "tied": build_tiny_llama(root / "tied", tok, TinyLlamaSpec(**small, tie_word_embeddings=True), seed=2),
        "llama3": build_tiny_llama(root / "llama3", tok, TinyLlamaSpec(**small, rope_scaling=llama3), seed=3),
    }
    qwen = Qwen2Config(vocab_size=320, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, **small)
    torch.manual_seed(4)
    model = Qwen2ForCausalLM(qwen).float()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(root / "qwen2"))
    AutoTokenizer.from_pretrained(str(root / "tok")).save_pretrained(str(root / "qwen2"))
    out["qwen2"] = root / "qwen2"
    return out
