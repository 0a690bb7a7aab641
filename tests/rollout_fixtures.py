"""Shared helpers for the rollout / weight-sync tests: tiny checkpoints and a transformers reference.

Every model here is a random tiny LLaMA (megatron_async.models.tiny) sharing one tokenizer, so any
of them can be pushed into a replica started from another.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_async.models.tiny import TinyLlamaSpec, build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.rollout import ReplicaSpec

LOGPROB_TOL = 1e-3  # fp32 vLLM vs transformers, max |diff| (measured ~5e-7 on these models)


def build_models(root: Path, seeds=(0, 1, 2)) -> list[Path]:
    """One tokenizer and a tiny LLaMA checkpoint per seed; returns the checkpoint dirs."""
    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    return [build_tiny_llama(root / f"model{s}", tok, seed=s) for s in seeds]


def build_variants(root: Path, hidden_size: int = 128, intermediate_size: int = 192) -> dict[str, Path]:
    """Architecture variants the learner and the weight sync must handle: GQA, tied embeddings,
    llama3 RoPE scaling, and Qwen2 (q/k/v biases, made non-zero). 2 layers, 4 heads / 2 KV groups.
    The default hidden 128 gives head_dim 32, the smallest vLLM's CPU attention takes; the learner
    tests (conftest's `tiny_ckpts`) use hidden 64."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    small = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    out = {
        "gqa": build_tiny_llama(root / "gqa", tok, TinyLlamaSpec(**small), seed=1),
        "tied": build_tiny_llama(root / "tied", tok, TinyLlamaSpec(**small, tie_word_embeddings=True), seed=2),
        "llama3": build_tiny_llama(root / "llama3", tok, TinyLlamaSpec(**small, rope_scaling=llama3), seed=3),
    }
    cfg = Qwen2Config(vocab_size=320, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **small)
    torch.manual_seed(4)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(root / "qwen2"))
    tok.save_pretrained(str(root / "qwen2"))
    out["qwen2"] = root / "qwen2"
    return out


def state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def spec(model_dir: Path) -> ReplicaSpec:
    return ReplicaSpec(model=str(model_dir), kv_cache_bytes=64 << 20, max_model_len=256)


def hf_logprobs(model_dir: Path, records) -> list[list[float]]:
    """transformers (fp32) logprobs of each record's completion tokens given its prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in records:
            ids = torch.tensor([list(r.prompt_token_ids) + list(r.token_ids)])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            pos = torch.arange(len(r.prompt_token_ids) - 1, ids.shape[1] - 1)
            out.append(logp[pos, torch.tensor(r.token_ids)].tolist())
    return out


def max_logprob_diff(model_dir: Path, records) -> float:
    """Largest |vLLM - transformers| over all sampled tokens of all records."""
    ref = hf_logprobs(model_dir, records)
    return max(abs(a - b) for r, lp in zip(records, ref) for a, b in zip(r.logprobs, lp))
