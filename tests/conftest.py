"""Shared fixtures: tiny HF checkpoints built in code (learner, conversion tests)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF checkpoints sharing one tokenizer: GQA (untied), tied embeddings, llama3 rope
    scaling, and a Qwen2 (q/k/v bias). Hidden 64, 2 layers, 4 heads / 2 KV groups, vocab 320."""
    from tests.rollout_fixtures import build_variants

    return build_variants(tmp_path_factory.mktemp("tiny_ckpts"), hidden_size=64, intermediate_size=96)
