"""The run's base model and its tokenizer: the HF checkpoint RL (or SFT) starts from.

`model.hf_path: tiny` builds a tiny LLaMA and a BPE tokenizer in the run directory (no download;
`models/tiny.py`), trained-for tokenizer on the synthetic train problems; any other value is an HF
checkpoint directory used as it is.
"""
from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer

from megatron_async.config import Config, ModelConfig
from megatron_async.data import load_problems
from megatron_async.io_utils import atomic_directory
from megatron_async.learner.model import read_arch
from megatron_async.models.tiny import TinyLlamaSpec, build_tiny_llama, build_tokenizer

log = logging.getLogger(__name__)


def prepare_base_model(cfg: Config) -> Path:
    """The HF checkpoint the run starts from: model.hf_path, or a tiny LLaMA built in the run dir."""
    if cfg.model.hf_path != "tiny":
        return Path(cfg.model.hf_path)
    out = cfg.run_dir / "base_model"
    if not (out / "config.json").exists():
        corpus = [f"{p.question}\n{p.solution}" for p in load_problems("synthetic", "train", 4000, cfg.run.seed)]
        spec = tiny_spec(cfg.model)
        with atomic_directory(out) as tmp:
            tokenizer = build_tokenizer(corpus, tmp, vocab_size=1024)
            build_tiny_llama(tmp, tokenizer, spec, seed=cfg.run.seed)
        log.info("built a tiny LLaMA (%s) and BPE tokenizer in %s", spec, out)
    return out


def tiny_spec(model: ModelConfig) -> TinyLlamaSpec:
    """The shape of the tiny LLaMA that model.tiny_* ask for (MLP 8/3 x hidden, a multiple of 16)."""
    return TinyLlamaSpec(hidden_size=model.tiny_hidden_size,
                         intermediate_size=model.tiny_hidden_size * 8 // 3 // 16 * 16,
                         num_hidden_layers=model.tiny_layers, num_attention_heads=model.tiny_heads,
                         num_key_value_heads=model.tiny_kv_heads)


def load_tokenizer(hf_dir: Path):
    """The checkpoint's tokenizer, checked against its model: every token id must have an embedding."""
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = read_arch(hf_dir).vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(f"{hf_dir}: the tokenizer has {len(tokenizer)} tokens but config.json has vocab_size={vocab}; "
                         "tokenizer and model do not belong together")
    if tokenizer.pad_token_id is None:  # padding is masked out everywhere; any id will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
