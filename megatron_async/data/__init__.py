"""Prompt data: GSM8k-style problems (`problem`; `synthetic` word problems made in code), files,
`datasets`, templates and tokenization (`prompts`), and the resumable prompt iterator (`iterator`)."""
from megatron_async.data.iterator import PromptIterator
from megatron_async.data.problem import Problem
from megatron_async.data.prompts import (
    DEFAULT_TEMPLATE,
    DataError,
    TokenizedPrompt,
    chat_messages,
    format_prompt,
    has_chat_template,
    load_file,
    load_hf_dataset,
    load_problems,
    load_prompts,
    load_train_prompts,
    render_chat,
    tokenize_prompts,
)
from megatron_async.data.synthetic import synthetic_problems

__all__ = [
    "DEFAULT_TEMPLATE",
    "DataError",
    "Problem",
    "PromptIterator",
    "TokenizedPrompt",
    "chat_messages",
    "format_prompt",
    "has_chat_template",
    "load_file",
    "load_hf_dataset",
    "load_problems",
    "load_prompts",
    "load_train_prompts",
    "render_chat",
    "synthetic_problems",
    "tokenize_prompts",
]
