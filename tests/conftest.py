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


# Packages only some tests need. A test module that imports one at the top is SKIPPED with the
# reason when the package is missing, instead of failing collection: `pytest -m gpu` imports every
# module under tests/ before it deselects by marker, and the GPU machine has neither mlflow nor
# vLLM (tests/hide_modules/sitecustomize.py reproduces that on any machine).
OPTIONAL_PACKAGES = ("mlflow", "vllm", "transformer_engine")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    import re

    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        missing = re.search(r"No module named '(%s)(\.[\w.]*)?'" % "|".join(OPTIONAL_PACKAGES), str(report.longrepr))
        if missing:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {missing.group(1)}, which is not installed")
    return report
