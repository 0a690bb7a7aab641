"""Tiny LLaMA-family models and a byte-level BPE tokenizer, built in code.

No model can be downloaded on our CPU machines, so tests and the CPU main job build their own:
`build_tokenizer` trains a byte-level BPE (GPT-2 style, so every string round-trips) on a text
corpus; `build_tiny_llama` writes a randomly initialised `LlamaForCausalLM` as an HF checkpoint
directory (config.json + model.safetensors + tokenizer files) that transformers, vLLM and our
HF -> Megatron conversion all load.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@dataclass
class TinyLlamaSpec:
    """Shape of a tiny LLaMA. Defaults: ~1M parameters, GQA (4 query heads, 2 KV groups)."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None)  # e.g. the llama3 variant
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02


def build_tokenizer(corpus: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on `corpus` and save it (tokenizer.json et al.) to out_dir.

    Numbers are BPE-merged like words, so a small number is one token and the synthetic data's
    place-value steps ("80 + 15 = 95") are lookups of small facts. On the CPU main job's tiny model
    LLaMA-style single digits gave a lower held-out pass@1 after SFT, both with one-line answers and
    with digit-by-digit column steps.

    Returns the `PreTrainedTokenizerFast`. Special tokens: <s> (bos), </s> (eos), <pad>.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    hf_tok.padding_side = "left"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def llama_config(spec: TinyLlamaSpec, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    # rope_theta, rope_scaling and torch_dtype: transformers 5 still takes (and converts) the keys
    # it no longer declares; config.json then reads as every LLaMA-family checkpoint writes it
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        attention_bias=spec.attention_bias,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )


def build_tiny_llama(out_dir: str | os.PathLike, tokenizer, spec: TinyLlamaSpec | None = None, seed: int = 0):
    """Write a randomly initialised LlamaForCausalLM + `tokenizer` as an HF checkpoint in out_dir.

    The vocabulary is the tokenizer's, rounded up to a multiple of 64 (so TP up to 8 divides it).
    Written with safetensors; returns out_dir as a Path.
    """
    spec = spec or TinyLlamaSpec()
    vocab = -(-len(tokenizer) // 64) * 64
    cfg = llama_config(spec, vocab, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return out


def default_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """A small English + arithmetic corpus to train the tokenizer on (no download)."""
    rng = random.Random(seed)
    names = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana"]
    things = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        nm, th = rng.choice(names), rng.choice(things)
        lines.append(
            f"Question: {nm} has {a} {th} and gets {b} more. How many {th} does {nm} have now?\n"
            f"Answer: {a} + {b} = {a + b}. #### {a + b}"
        )
        lines.append(f"What is {a} * {b}? {a} * {b} = {a * b}. The answer is {a * b}.")
    return lines
