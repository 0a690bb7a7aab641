"""Prompt data: GSM8k-style problems (files, `datasets`, synthetic), templates, tokenization,
and the resumable prompt iterator."""
from megatron_async.data.iterator import PromptIterator
from megatron_async.data.problem import Problem
from megatron_async.data.prompts import (
    DEFAULT_TEMPLATE,
    DataError,
    TokenizedPrompt,
    format_prompt,
    load_file,
    load_hf_dataset,
    load_problems,
    load_prompts,
    load_train_prompts,
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
    "load_prompts",
    "load_train_prompts",
    "synthetic_problems",
    "tokenize_prompts",
]
