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

A save that fails (a full disk, a folder that turned read-only) raises `CheckpointSaveError` on
every rank: what it wrote is removed, `latest` and the previous checkpoint are left as they were,
and the message names the checkpoint, the error and the previous one to resume from.

`--resume` continues from `latest`, or from `run.resume_from` (a step_N folder name or a path);
the preflight verifies that checkpoint's checksums first (`checkpoint_problem`), and names the
newest intact one (`newest_intact_checkpoint`) when it is not whole. The first save after
resuming from an earlier checkpoint removes the ones after it (a continuation it replaces).
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_async.config import Config
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.checkpoint import MANIFEST, load_checkpoint, rank0_then_share, read_manifest, save_checkpoint

if TYPE_CHECKING:  # the states hold the checkpoint's contents; they never import this module's callers
    from megatron_async.run.learner_state import LearnerState
    from megatron_async.run.report import StepReport
    from megatron_async.run.rollout_state import RolloutState

log = logging.getLogger(__name__)

ROLLOUT_STATE = "rollout_state.json"
VALUE_STAGING = "value.staging"  # not step_*: a crash's leftover is never loaded, and replaced next save
KEEP = 2  # newest checkpoints kept
STEP_DIR = re.compile(r"step_(\d+)")  # a checkpoint's folder; step_N.tmp / step_N.old are a save's leftovers


class CheckpointSaveError(RuntimeError):
    """A run checkpoint could not be written (raised on every rank); the previous one is intact."""


def checkpoint_root(cfg: Config) -> Path:
    return cfg.run_dir / "checkpoints"


def checkpoint_step(path: Path) -> int:
    """The learner steps done at checkpoint `path` (its folder's name, step_000010 -> 10)."""
    match = STEP_DIR.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint folder (step_N)")
    return int(match[1])


def run_checkpoints(cfg: Config) -> list[Path]:
    """The run's checkpoint folders, oldest first (not a save's leftovers)."""
    return sorted((p for p in checkpoint_root(cfg).glob("step_*") if STEP_DIR.fullmatch(p.name) and p.is_dir()),
                  key=checkpoint_step)


def save_run_checkpoint(cfg: Config, learner: LearnerState, ctrl: dist.ProcessGroup, next_step: int,
                        rollout: RolloutState | None = None, report: StepReport | None = None) -> Path:
    """All ranks; learner shards come from every rank. Rank 0 of `ctrl` writes rollout_state.json
    with the state of `rollout` and `report` (rank 0's; None where a caller has none: null in the file).
    A failure on any rank is a `CheckpointSaveError` on every rank (module docstring): rank 0's own
    writes share their outcome (`rank0_then_share`) like the collective ones, so no rank waits for
    one that gave up."""
    root = checkpoint_root(cfg)
    path = root / f"step_{next_step:06d}"
    rank0 = dist.get_rank(ctrl) == 0
    previous = latest_checkpoint(cfg)
    state_dir = Path(tempfile.mkdtemp(prefix="rollout-state-")) if rank0 else None

    def write_rollout_state() -> dict[str, Path]:  # rank 0 only
        assert state_dir is not None
        state = {"next_step": next_step, "version": learner.version,
                 "rollout": None if rollout is None else rollout.state_dict(),
                 "report": None if report is None else report.state_dict()}
        (state_dir / ROLLOUT_STATE).write_text(json.dumps(state))
        return {ROLLOUT_STATE: state_dir / ROLLOUT_STATE}

    try:
        files = rank0_then_share(write_rollout_state)  # read on rank 0 only (save_checkpoint)
        parts = {}
        if learner.value is not None:  # PPO: saved complete first, then moved into the run checkpoint
            v = learner.value
            parts["value"] = save_checkpoint(root / VALUE_STAGING, v.model, v.optimizer, v.scheduler)
        p = learner.policy
        save_checkpoint(path, p.model, p.optimizer, p.scheduler,
                        extra={"next_step": next_step, "version": learner.version}, files=files, parts=parts)
        rank0_then_share(lambda: atomic_write_text(root / "latest", path.name))
    # any failure of the save, re-raised as one error naming it; torch's CheckpointException (what
    # megatron's writer raises) is a BaseException
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        if rank0:  # free what the save took (a full disk needs the room); never the previous checkpoint
            written = [path] if path != previous else []  # complete, but `latest` could not name it
            for partial in (*written, path.with_name(path.name + ".tmp"), root / VALUE_STAGING,
                            root / f"{VALUE_STAGING}.tmp"):
                shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointSaveError(_save_failure(path, e, previous)) from e
    finally:
        if state_dir is not None:
            shutil.rmtree(state_dir, ignore_errors=True)
    if rank0:
        _prune(cfg, path)
        log.info("checkpoint saved: %s", path)
    dist.barrier(group=ctrl)
    return path


def _save_failure(path: Path, error: BaseException, previous: Path | None) -> str:
    """The one line a failed save stops the run with: which checkpoint, what error, what is intact."""
    cause = _root_cause(error)
    what = " ".join(str(cause).split())[:300]  # one line; a wrapped error can carry a traceback
    kept = (f"the previous checkpoint, {previous} (step {checkpoint_step(previous)}), is intact and `latest` "
            "still names it" if previous is not None else "no earlier checkpoint exists")
    return (f"could not save checkpoint {path} (step {checkpoint_step(path)}): {type(cause).__name__}: {what}; "
            f"its partial files were removed and {kept}")


def _root_cause(error: BaseException) -> BaseException:
    """The OSError under the wrappers of `error` (its __cause__ / __context__ chain, and the per-rank
    failures of a CheckpointException, whose entries are (exception, traceback) pairs), or the
    innermost error when there is none."""
    while not isinstance(error, OSError):
        failures = getattr(error, "failures", None) if isinstance(error, CheckpointException) else None
        inner = next(iter(failures.values()))[0] if failures else error.__cause__ or error.__context__
        if inner is None:
            break
        error = inner
    return error


def _prune(cfg: Config, saved: Path) -> None:
    """Rank 0: keep `saved` and the KEEP - 1 checkpoints before it; remove the others: older ones,
    and any after it (left by the continuation that a resume from an earlier checkpoint replaces)."""
    older = [p for p in run_checkpoints(cfg) if checkpoint_step(p) < checkpoint_step(saved)]
    newer = [p for p in run_checkpoints(cfg) if checkpoint_step(p) > checkpoint_step(saved)]
    for old in older[:len(older) - (KEEP - 1)] + newer:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(cfg: Config) -> Path | None:
    marker = checkpoint_root(cfg) / "latest"
    if not marker.exists():
        return None
    return checkpoint_root(cfg) / marker.read_text().strip()


def resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint `--resume` continues from: run.resume_from (a bare folder name is one of this
    run's, under checkpoints/; anything else a path), else the latest (None: nothing saved yet)."""
    name = cfg.run.resume_from
    if not name:
        return latest_checkpoint(cfg)
    return checkpoint_root(cfg) / name if "/" not in name else Path(name).expanduser()


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint `path` cannot be loaded (a file missing, or not matching its manifest's
    sha256; no manifest), or None when it is whole. Reads every file once (sha256)."""
    try:
        read_manifest(path)
    except json.JSONDecodeError as e:  # before ValueError, which it is: its message names no file
        return f"checkpoint {path}: {MANIFEST} is not JSON ({e})"
    except KeyError as e:
        return f"checkpoint {path}: {MANIFEST} has no {e} entry"
    except (OSError, ValueError) as e:  # a missing manifest or file, a checksum that differs
        return str(e)
    return None


def newest_intact_checkpoint(cfg: Config, besides: Path) -> Path | None:
    """The run's newest checkpoint other than `besides` whose files all verify (None: none)."""
    return next((p for p in reversed(run_checkpoints(cfg)) if p != besides and checkpoint_problem(p) is None), None)


def load_run_checkpoint(cfg: Config, learner: LearnerState, path: Path, rollout: RolloutState | None = None,
                        report: StepReport | None = None) -> int:
    """All ranks: restore the learner state, and rank 0's `rollout` and `report` where given (before
    the producer starts). Returns the next learner step (= the policy version the checkpoint holds).
    Resumed from another than the latest (run.resume_from), `latest` names `path` from then on, so
    that a later plain --resume continues this run, not the one it went back from."""
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
    root = checkpoint_root(cfg)
    if dist.get_rank() == 0 and latest_checkpoint(cfg) != path:  # run.resume_from: the run goes on from here
        atomic_write_text(root / "latest", path.name if path.parent == root else str(path.resolve()))
    return state["next_step"]
