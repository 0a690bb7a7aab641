"""The learner the tests/dist workers build: a tiny HF checkpoint as the learner's model, its
weights loaded, and (for the workers that train) its optimizer. Needs `init_parallel` first, like
`build_model`; the layout (TP, PP) is the one the worker initialised."""
from __future__ import annotations

import os

import torch

from megatron_async.learner.mapping import load_hf_weights
from megatron_async.learner.model import LearnerModel, build_model
from megatron_async.learner.optimizer import OptimSettings, build_optimizer
from megatron_async.learner.perf import PerfSettings


def loaded_model(hf_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 perf: PerfSettings | None = None) -> LearnerModel:
    """`hf_dir`'s model on this rank (`build_model`: dtype None = auto) with its HF weights loaded."""
    model = build_model(hf_dir, dtype=dtype, perf=perf)
    load_hf_weights(model, hf_dir)
    return model


def tiny_learner(hf_dir: str | os.PathLike, settings: OptimSettings, dtype: torch.dtype | None = None,
                 perf: PerfSettings | None = None):
    """`loaded_model(hf_dir)` with its optimizer: `build_optimizer`'s (DDP-wrapped model, optimizer,
    scheduler)."""
    return build_optimizer(loaded_model(hf_dir, dtype, perf), settings)
