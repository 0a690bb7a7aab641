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

With trainer.async_save (`RunCheckpoints`), the shards are written by a background process per
rank through megatron's `AsyncCallsQueue` while the learner goes on; at each step boundary the
ranks complete a save that every rank has written (manifest, rename, `latest`). One save at a time;
a stop and the run's end wait for the one under way; killed before that, the run leaves
`step_X.tmp` and `latest` naming the previous checkpoint.

A save that fails (a full disk, a folder that turned read-only) raises `CheckpointSaveError` on
every rank (for a background save, at the boundary that completes it): what it wrote is removed, `latest` and the previous checkpoint are left as they were,
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_async.config import Config
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.checkpoint import (MANIFEST, begin_checkpoint, load_checkpoint, rank0_then_share, read_manifest,
                                              save_checkpoint)

if TYPE_CHECKING:  # the states hold the checkpoint's contents; they never import this module's callers
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

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


@dataclass
class RunSave:
    """A run checkpoint under way: megatron's request that writes it (learner/checkpoint.py's
    `begin_checkpoint`, with `latest` and the pruning added to its finalize functions), and what a
    failure removes and says."""
    path: Path
    previous: Path | None  # what `latest` named when the save began
    rank0: bool
    state_dir: Path | None  # rank 0's rollout_state.json until the save copies it in
    request: AsyncRequest | None = None  # set once `begin_run_checkpoint` got it

    @contextmanager
    def failing_as_save_error(self):
        """Any failure of the save, re-raised as one `CheckpointSaveError` naming it, after removing
        what it wrote; torch's CheckpointException (what megatron's writer raises) is a BaseException."""
        try:
            yield
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            if self.rank0:  # free what the save took (a full disk needs the room); never the previous checkpoint
                root = self.path.parent
                written = [self.path] if self.path != self.previous else []  # complete, but `latest` could not name it
                for partial in (*written, self.path.with_name(self.path.name + ".tmp"), root / VALUE_STAGING,
                                root / f"{VALUE_STAGING}.tmp", self.state_dir):
                    if partial is not None:
                        shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointSaveError(_save_failure(self.path, e, self.previous)) from e


def begin_run_checkpoint(cfg: Config, learner: LearnerState, ctrl: dist.ProcessGroup, next_step: int,
                         rollout: RolloutState | None = None, report: StepReport | None = None) -> RunSave:
    """All ranks: start checkpoint step_<next_step>; its request, once run (`execute_sync` or
    megatron's `AsyncCallsQueue`), makes it complete and points `latest` at it. Rank 0 of `ctrl`
    writes rollout_state.json now, with the state of `rollout` and `report` (rank 0's; None where a
    caller has none: null in the file); PPO's value model is saved now, before the policy's request.
    A failure here, or of the request (run it inside `failing_as_save_error`), is a
    `CheckpointSaveError` on every rank (module docstring): rank 0's own writes share their outcome
    (`rank0_then_share`) like the collective ones, so no rank waits for one that gave up."""
    root = checkpoint_root(cfg)
    path = root / f"step_{next_step:06d}"
    rank0 = dist.get_rank(ctrl) == 0
    state_dir = Path(tempfile.mkdtemp(prefix="rollout-state-")) if rank0 else None
    save = RunSave(path, latest_checkpoint(cfg), rank0, state_dir)

    def write_rollout_state() -> dict[str, Path]:  # rank 0 only
        assert state_dir is not None
        state = {"next_step": next_step, "version": learner.version,
                 "rollout": None if rollout is None else rollout.state_dict(),
                 "report": None if report is None else report.state_dict()}
        (state_dir / ROLLOUT_STATE).write_text(json.dumps(state))
        return {ROLLOUT_STATE: state_dir / ROLLOUT_STATE}

    def make_latest() -> None:  # all ranks: the request's last finalize function
        rank0_then_share(lambda: atomic_write_text(root / "latest", path.name))
        if rank0:
            assert state_dir is not None
            shutil.rmtree(state_dir, ignore_errors=True)
            _prune(cfg, path)
            log.info("checkpoint saved: %s", path)
        dist.barrier(group=ctrl)

    with save.failing_as_save_error():
        files = rank0_then_share(write_rollout_state)  # read on rank 0 only (begin_checkpoint's finish)
        parts = {}
        if learner.value is not None:  # PPO: saved complete first, then moved into the run checkpoint
            v = learner.value
            parts["value"] = save_checkpoint(root / VALUE_STAGING, v.model, v.optimizer, v.scheduler)
        p = learner.policy
        save.request = begin_checkpoint(path, p.model, p.optimizer, p.scheduler,
                                        extra={"next_step": next_step, "version": learner.version},
                                        files=files, parts=parts)
        save.request.add_finalize_fn(make_latest)
    return save


def save_run_checkpoint(cfg: Config, learner: LearnerState, ctrl: dist.ProcessGroup, next_step: int,
                        rollout: RolloutState | None = None, report: StepReport | None = None) -> Path:
    """All ranks: `begin_run_checkpoint`, run to the end before returning (its path, complete)."""
    save = begin_run_checkpoint(cfg, learner, ctrl, next_step, rollout, report)
    with save.failing_as_save_error():
        assert save.request is not None
        save.request.execute_sync()
    return save.path


class RunCheckpoints:
    """The run's checkpoint saves, one at a time (all ranks, at step boundaries). With
    `asynchronous` (trainer.async_save) a save's shards are written and hashed by a background
    process through megatron's `AsyncCallsQueue` while the learner goes on; `poll` at each boundary
    completes a save every rank has written (manifest, rename, `latest`); `wait` waits for it."""

    def __init__(self, cfg: Config, learner: LearnerState, ctrl: dist.ProcessGroup, asynchronous: bool):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.cfg, self.learner, self.ctrl = cfg, learner, ctrl
        self.queue = AsyncCallsQueue() if asynchronous else None
        self.pending: RunSave | None = None

    def save(self, next_step: int, rollout: RolloutState | None = None, report: StepReport | None = None) -> Path:
        """Checkpoint step_<next_step>: complete on return, or (asynchronous) being written; a save
        still under way is completed first."""
        self.wait()
        save = begin_run_checkpoint(self.cfg, self.learner, self.ctrl, next_step, rollout, report)
        assert save.request is not None
        with save.failing_as_save_error():
            if self.queue is None:
                save.request.execute_sync()
            else:
                self.queue.schedule_async_request(save.request)
                self.pending = save
        return save.path

    def poll(self) -> None:
        """All ranks: complete the save under way if every rank's writer is done (one all-reduce)."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """All ranks: wait for the save under way, and complete it."""
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        if self.queue is None or self.pending is None:
            return
        with self.pending.failing_as_save_error():
            try:
                done = self.queue.maybe_finalize_async_calls(blocking=blocking)
            except BaseException:
                self.pending = None  # megatron's queue dropped the failed call too
                raise
        if done:
            self.pending = None

    def close(self) -> None:
        """A save still under way (the run ends on an error) is stopped, not completed: `latest`
        keeps naming the previous checkpoint."""
        if self.queue is not None and self.pending is not None:
            for call in self.queue.async_calls:  # megatron's queue.close(abort=True) stops persistent callers only
                call.async_caller.close(abort=True)  # kills the save's writer process
            self.queue.async_calls.clear()
            self.pending = None


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


def checkpoint_problem(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why checkpoint `path` cannot be loaded (no manifest, a file missing, or not matching its
    manifest's size or sha256), or None when it is whole. Reads each file once, hashed in threads;
    with `share` = (rank, world) only that rank's share of the files (`file_share`)."""
    try:
        read_manifest(path, share=share)
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
