"""Run checkpoints: learner state + rollout state, written atomically, resumed exactly.

    <run dir>/checkpoints/step_000010/   learner.checkpoint directory (dist_checkpointing: model,
                                         optimizer, scheduler; manifest with sha256 of every file)
        value/                           PPO only: the value model's own learner checkpoint (model,
                                         optimizer, scheduler), covered by the outer manifest
        rollout_state.json               the rollout buffer (generated, untrained batches), the
                                         prompt iterator position after the last generated batch,
                                         the policy version, metric history
    <run dir>/checkpoints/latest         name of the newest complete checkpoint (atomic rewrite)

A checkpoint taken after learner step s holds version s+1. Batches the producer had finished are
saved; a batch still being generated is not (its prompts are not consumed in the saved iterator
position), so on resume it is generated again, by the same policy version with the same seeds.
A crash mid-save leaves `step_X.tmp`, which is never loaded: `latest` only ever names a directory
whose manifest was written last and whose checksums verify on load.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_async.config import Config
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.checkpoint import load_checkpoint, save_checkpoint
from megatron_async.rollout.producer import batch_from_json, batch_to_json

if TYPE_CHECKING:  # the states hold the checkpoint's contents; they never import this module's callers
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run.rollout_state import RolloutState

log = logging.getLogger(__name__)

ROLLOUT_STATE = "rollout_state.json"
VALUE_STAGING = "value.staging"  # not step_*: a crash's leftover is never loaded, and replaced next save
KEEP = 2  # newest checkpoints kept


def checkpoint_root(cfg: Config) -> Path:
    return cfg.run_dir / "checkpoints"


def save_run_checkpoint(cfg: Config, learner: LearnerState, rollout: RolloutState | None,
                        ctrl: dist.ProcessGroup, next_step: int) -> Path:
    """All ranks. Rank 0 (the one with `rollout`) contributes the rollout state; learner shards come
    from every rank."""
    root = checkpoint_root(cfg)
    path = root / f"step_{next_step:06d}"
    files = {}
    tmpdir = None
    if rollout is not None:
        buffered = rollout.producer.buffered()
        state = {
            "next_step": next_step,
            "version": learner.version,
            "buffer": [batch_to_json(b) for b in buffered],
            "data_state": buffered[-1].data_state if buffered else rollout.data_state,
            "history": rollout.history,
            "max_lag": rollout.producer.max_lag,  # the lag in force (rollout.max_lag: auto moves it)
        }
        tmpdir = Path(tempfile.mkdtemp(prefix="rollout-state-"))
        (tmpdir / ROLLOUT_STATE).write_text(json.dumps(state))
        files = {ROLLOUT_STATE: tmpdir / ROLLOUT_STATE}
    parts = {}
    if learner.value is not None:  # PPO: saved complete first, then moved into the run checkpoint
        v = learner.value
        parts["value"] = save_checkpoint(root / VALUE_STAGING, v.chunks, v.optimizer, v.scheduler)
    p = learner.policy
    save_checkpoint(path, p.chunks, p.optimizer, p.scheduler,
                    extra={"next_step": next_step, "version": learner.version}, files=files, parts=parts)
    if rollout is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
        atomic_write_text(root / "latest", path.name)
        for old in sorted(root.glob("step_*"))[:-KEEP]:
            if old.is_dir() and not old.name.endswith(".tmp"):
                shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved: %s", path)
    dist.barrier(group=ctrl)
    return path


def latest_checkpoint(cfg: Config) -> Path | None:
    marker = checkpoint_root(cfg) / "latest"
    if not marker.exists():
        return None
    return checkpoint_root(cfg) / marker.read_text().strip()


def load_run_checkpoint(cfg: Config, learner: LearnerState, path: Path) -> dict:
    """All ranks: restore learner state; returns the rollout state (meaningful on rank 0)."""
    p = learner.policy
    extra = load_checkpoint(path, p.chunks, p.optimizer, p.scheduler)
    if learner.value is not None:
        if not (path / "value").is_dir():
            raise ValueError(f"{path} has no value model (value/): it was not saved by a run with a value model, "
                             f"so trainer.algorithm={cfg.trainer.algorithm} cannot resume from it")
        v = learner.value
        load_checkpoint(path / "value", v.chunks, v.optimizer, v.scheduler)
    state = json.loads((path / ROLLOUT_STATE).read_text())
    if state["next_step"] != extra["next_step"]:
        raise ValueError(f"{path}: {ROLLOUT_STATE} is for step {state['next_step']}, the learner state for {extra['next_step']}")
    state["buffer"] = [batch_from_json(b) for b in state["buffer"]]
    log.info("resumed from %s: next step %d, %d buffered batches", path, state["next_step"], len(state["buffer"]))
    return state
