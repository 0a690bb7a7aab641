"""Shared helpers for the rollout / weight-sync tests: tiny checkpoints and a transformers reference.

Every model here is a random tiny LLaMA (megatron_async.models.tiny) sharing one tokenizer, so any
of them can be pushed into a replica started from another.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_async.models.tiny import build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.rollout import ReplicaSpec

LOGPROB_TOL = 1e-3  # fp32 vLLM vs transformers, max |diff| (measured ~5e-7 on these models)


def build_models(root: Path, seeds=(0, 1, 2)) -> list[Path]:
    """One tokenizer and a tiny LLaMA checkpoint per seed; returns the checkpoint dirs."""
    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    return [build_tiny_llama(root / f"model{s}", tok, seed=s) for s in seeds]


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
