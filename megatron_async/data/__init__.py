"""Prompt data: GSM8k-style problems (files, `datasets`, synthetic), templates, tokenization,
and the resumable prompt iterator."""
from megatron_async.data.iterator import PromptIterator
from megatron_async.data.prompts import (
    DEFAULT_TEMPLATE,
    DataError,
    Problem,
    TokenizedPrompt,
    format_prompt,
    load_file,
    load_hf_dataset,
    load_problems,
    tokenize_prompts,
)
from megatron_async.data.synthetic import synthetic_problems

__all__ = [
    "DEFAULT_TEMPLATE",
    "DataError",
    "Problem",
    "PromptIterator",
    "TokenizedPrompt",
    "format_prompt",
    "load_file",
    "load_hf_dataset",
    "load_problems",
    "synthetic_problems",
    "tokenize_prompts",
]
