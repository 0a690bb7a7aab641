"""Run checkpoints: learner state + rollout state, written atomically, resumed exactly.

    <run dir>/checkpoints/step_000010/   learner.checkpoint directory (dist_checkpointing: model,
                                         optimizer, scheduler; manifest with sha256 of every file)
        value/                           PPO only: the value model's own learner checkpoint (model,
                                         optimizer, scheduler), covered by the outer manifest
        rollout_state.json               rank 0's state: the step and policy version, the rollout
                                         side's (`RolloutState.state_dict`: generated, untrained
                                         batches, the prompt position after the last of them, the
                                         lag and balance controllers) and the metric history
                                         (`StepReport.state_dict`)
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

if TYPE_CHECKING:  # the states hold the checkpoint's contents; they never import this module's callers
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run.report import StepReport
    from megatron_async.run.rollout_state import RolloutState

log = logging.getLogger(__name__)

ROLLOUT_STATE = "rollout_state.json"
VALUE_STAGING = "value.staging"  # not step_*: a crash's leftover is never loaded, and replaced next save
KEEP = 2  # newest checkpoints kept


def checkpoint_root(cfg: Config) -> Path:
    return cfg.run_dir / "checkpoints"


def save_run_checkpoint(cfg: Config, learner: LearnerState, ctrl: dist.ProcessGroup, next_step: int,
                        rollout: RolloutState | None = None, report: StepReport | None = None) -> Path:
    """All ranks; learner shards come from every rank. Rank 0 of `ctrl` writes rollout_state.json
    with the state of `rollout` and `report` (rank 0's; None where a caller has none: null in the file)."""
    root = checkpoint_root(cfg)
    path = root / f"step_{next_step:06d}"
    rank0 = dist.get_rank(ctrl) == 0
    files = {}
    tmpdir = None
    if rank0:
        state = {"next_step": next_step, "version": learner.version,
                 "rollout": None if rollout is None else rollout.state_dict(),
                 "report": None if report is None else report.state_dict()}
        tmpdir = Path(tempfile.mkdtemp(prefix="rollout-state-"))
        (tmpdir / ROLLOUT_STATE).write_text(json.dumps(state))
        files = {ROLLOUT_STATE: tmpdir / ROLLOUT_STATE}
    parts = {}
    if learner.value is not None:  # PPO: saved complete first, then moved into the run checkpoint
        v = learner.value
        parts["value"] = save_checkpoint(root / VALUE_STAGING, v.model, v.optimizer, v.scheduler)
    p = learner.policy
    save_checkpoint(path, p.model, p.optimizer, p.scheduler,
                    extra={"next_step": next_step, "version": learner.version}, files=files, parts=parts)
    if rank0:
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


def load_run_checkpoint(cfg: Config, learner: LearnerState, path: Path, rollout: RolloutState | None = None,
                        report: StepReport | None = None) -> int:
    """All ranks: restore the learner state, and rank 0's `rollout` and `report` where given (before
    the producer starts). Returns the next learner step (= the policy version the checkpoint holds)."""
    p = learner.policy
    extra = load_checkpoint(path, p.model, p.optimizer, p.scheduler)
    if learner.value is not None:
        if not (path / "value").is_dir():
            raise ValueError(f"{path} has no value model (value/): it was not saved by a run with a value model, "
                             f"so trainer.algorithm={cfg.trainer.algorithm} cannot resume from it")
        v = learner.value
        load_checkpoint(path / "value", v.model, v.optimizer, v.scheduler)
    state = json.loads((path / ROLLOUT_STATE).read_text())
    if state["next_step"] != extra["next_step"]:
        raise ValueError(f"{path}: {ROLLOUT_STATE} is for step {state['next_step']}, the learner state for {extra['next_step']}")
    for part, target in (("rollout", rollout), ("report", report)):
        if target is None:
            continue
        if state.get(part) is None:
            raise ValueError(f"{path}: {ROLLOUT_STATE} holds no {part} state (saved by a run without one, or by "
                             f"an older version of megatron_async): this run cannot resume from it")
        target.load_state_dict(state[part])
    if rollout is not None:
        log.info("resumed from %s: next step %d, %d buffered batches", path, state["next_step"],
                 len(state["rollout"]["buffer"]))
    return state["next_step"]
