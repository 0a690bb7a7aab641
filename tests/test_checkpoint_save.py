"""A run checkpoint save that fails (run/checkpoint.py): the previous checkpoint stays intact and
loadable, `latest` keeps naming it, the failed save's partial files are removed, and every rank
gets one `CheckpointSaveError` naming the checkpoint, the error and the previous step.

Fast tier: the save's own logic on a one-rank gloo group, around a writer that fails as a full disk
does. Integration: the real writer (megatron `dist_checkpointing`, whose file writes run in forked
processes) on a real learner in this process, refused by the file system itself: a file-size limit
(`RLIMIT_FSIZE`: every write past it fails with EFBIG, as past a full disk's last block) and, where
this process may mount one, a tmpfs that is full (ENOSPC) and then read-only (EROFS).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import resource
import signal
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from megatron_async.config import load_config
from megatron_async.io_utils import replace_dir
from megatron_async.run import checkpoint as run_checkpoint
from megatron_async.run.checkpoint import (CheckpointSaveError, checkpoint_root, latest_checkpoint, load_run_checkpoint,
                                           save_run_checkpoint)
from megatron_async.run.learner_state import LearnerState


def run_config(out_dir: Path):
    return load_config(None, [f"run.out_dir={out_dir}"])


def fake_learner(version: int) -> LearnerState:
    """What save_run_checkpoint reads of a learner when the writer is a stand-in."""
    fake = SimpleNamespace(value=None, policy=SimpleNamespace(model=None, optimizer=None, scheduler=None), version=version)
    return cast(LearnerState, fake)


def writer_request(write):
    """A stand-in for learner/checkpoint.py's `begin_checkpoint`: megatron's request (no background
    writer) whose finalize function runs `write(ckpt_dir, files)`."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    def begin(ckpt_dir, model, optimizer, scheduler, extra=None, files=None, parts=None):
        return AsyncRequest(None, (), [lambda: write(ckpt_dir, files)])
    return begin


def test_a_failed_save_keeps_the_previous_checkpoint_and_removes_its_partial_files(one_rank_group, monkeypatch,
                                                                                    tmp_path):
    """The learner's writer fills `<dir>.tmp` and renames it into place when done (learner/checkpoint.py);
    here it stops half way with ENOSPC at the second save, and rank 0's own write (`latest`) with EROFS
    at the third."""
    def writer(ckpt_dir, files):
        tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
        (tmp / "dist").mkdir(parents=True)
        (tmp / "dist" / "shard").write_bytes(b"x" * 1000)
        if ckpt_dir.name == "step_000002":
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "dist" / "shard"))
        for name, src in files.items():
            (tmp / name).write_bytes(src.read_bytes())
        return replace_dir(tmp, ckpt_dir)

    monkeypatch.setattr(run_checkpoint, "begin_checkpoint", writer_request(writer))
    cfg, learner = run_config(tmp_path), fake_learner(version=1)
    first = save_run_checkpoint(cfg, learner, one_rank_group, next_step=1)
    saved = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointSaveError) as e:
        save_run_checkpoint(cfg, learner, one_rank_group, next_step=2)
    root = checkpoint_root(cfg)
    assert str(e.value) == (f"could not save checkpoint {root}/step_000002 (step 2): OSError: [Errno 28] No space left "
                            f"on device: '{root}/step_000002.tmp/dist/shard'; its partial files were removed and the "
                            f"previous checkpoint, {first} (step 1), is intact and `latest` still names it")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no step_000002(.tmp)
    assert latest_checkpoint(cfg) == first and {p: p.read_bytes() for p in saved} == saved

    def read_only(path, text):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(run_checkpoint, "atomic_write_text", read_only)
    with pytest.raises(CheckpointSaveError, match=r"could not save checkpoint .*step_000003 \(step 3\): OSError: "
                                                  r"\[Errno 30\] Read-only file system: .*latest'; .* the previous "
                                                  r"checkpoint, .*step_000001 \(step 1\), is intact"):
        save_run_checkpoint(cfg, learner, one_rank_group, next_step=3)
    assert latest_checkpoint(cfg) == first


def test_a_save_without_an_earlier_checkpoint_says_there_is_none(one_rank_group, monkeypatch, tmp_path):
    def full_disk(ckpt_dir, files):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_checkpoint, "begin_checkpoint", writer_request(full_disk))
    learner = fake_learner(version=0)
    with pytest.raises(CheckpointSaveError, match=r"\(step 5\): OSError: \[Errno 28\] No space left on device; its "
                                                  r"partial files were removed and no earlier checkpoint exists$"):
        save_run_checkpoint(run_config(tmp_path), learner, one_rank_group, next_step=5)


def test_the_ranks_verify_shares_that_cover_every_file_once_and_balance_the_bytes():
    from megatron_async.learner.checkpoint import file_share

    sizes = {f"dist/__{r}_{i}.distcp": 1000 * (r + 1) + i for r in range(4) for i in range(2)}
    manifest: dict[str, dict] = {"files": {name: "digest" for name in [*sizes, "common.pt"]},
                                 "sizes": {**sizes, "common.pt": 10}}
    shares = [file_share(manifest, rank, 3) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(manifest["files"])
    loads = [sum(manifest["sizes"][name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values()), loads
    assert file_share(manifest, 0, 1) == sorted(manifest["files"], key=lambda n: (-manifest["sizes"][n], n))


def test_a_file_of_another_size_or_content_is_named(tmp_path):
    """Sizes are checked for every file a rank verifies, contents where asked (`check_files`)."""
    from megatron_async.learner.checkpoint import check_files, file_digests

    for name, data in (("dist/__0_0.distcp", b"a" * 4096), ("rollout_state.json", b"{}")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    digests = file_digests(tmp_path, sorted(p for p in tmp_path.rglob("*") if p.is_file()))
    manifest = {"files": {n: d["sha256"] for n, d in digests.items()}, "sizes": {n: d["bytes"] for n, d in digests.items()}}
    check_files(tmp_path, manifest)
    with open(tmp_path / "dist" / "__0_0.distcp", "r+b") as f:
        f.write(b"b")  # the same size
    check_files(tmp_path, manifest, contents=False)
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path}: file dist/__0_0.distcp is corrupt \(sha256 differs"):
        check_files(tmp_path, manifest)
    check_files(tmp_path, manifest, ["rollout_state.json"])  # another rank's share
    with open(tmp_path / "dist" / "__0_0.distcp", "ab") as f:
        f.write(b"padding")
    with pytest.raises(ValueError, match=r"file dist/__0_0.distcp is corrupt \(4103 bytes, the manifest says 4096\)"):
        check_files(tmp_path, manifest, contents=False)
    (tmp_path / "rollout_state.json").unlink()
    with pytest.raises(ValueError, match=r"file rollout_state.json listed in the manifest is missing"):
        check_files(tmp_path, manifest, ["rollout_state.json"])


def test_the_resume_command_a_run_prints_leaves_run_resume_from_out():
    """A run resumed from an earlier checkpoint moved `latest` to it; repeating the override would go back again."""
    from megatron_async.run.stop import resume_command

    assert resume_command("c.yaml", ["run.name=x", "run.resume_from=step_000010", "trainer.steps=9"]) == \
        "megatron-async train c.yaml run.name=x trainer.steps=9 --resume"


# --------------------------------------------------------------------------- the real writer


@pytest.fixture(scope="module")
def learner(one_rank_group, tiny_ckpts):
    """A real one-rank learner (megatron-core model, Adam, LR schedule) in this process."""
    from megatron.core import parallel_state

    from megatron_async.learner.mapping import load_hf_weights
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer
    from megatron_async.learner.parallel import init_parallel
    from megatron_async.run.learner_state import Trainable

    with pytest.MonkeyPatch.context() as env:  # init_parallel sets them: not for later tests (convert's relaunch)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.setenv(name, "")  # records the value before (often none), which the context's end restores
            env.delenv(name)
        init_parallel(1, 1)  # the default group is one_rank_group's
        model = build_model(tiny_ckpts["gqa"])
        load_hf_weights(model, tiny_ckpts["gqa"])
        policy = Trainable(*build_optimizer(model, OptimSettings(lr=1e-3)))  # not stepped: the first test saves so
        yield SimpleNamespace(value=None, policy=policy, version=1)
        parallel_state.destroy_model_parallel()


def weights(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.policy.model.chunks[0].named_parameters()}


def assert_loads_the_saved_weights(cfg, learner, path: Path, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for p in learner.policy.model.chunks[0].parameters():
            p.add_(1.0)  # so that a load that restores nothing fails below
    assert load_run_checkpoint(cfg, learner, path) == 1
    assert all(torch.equal(p, saved[n]) for n, p in learner.policy.model.chunks[0].named_parameters())


@pytest.mark.integration  # dist_checkpointing's save starts a process
def test_a_checkpoint_saved_before_the_first_optimizer_step_loads(learner, one_rank_group, tmp_path):
    """No Adam state yet (Online DPO's first batches may form no pair; a stop signal at step 0): the
    checkpoint holds model and schedule, and loads into a learner that then steps as usual."""
    assert len(learner.policy.optimizer.state) == 0
    cfg = run_config(tmp_path)
    saved = weights(learner)
    path = save_run_checkpoint(cfg, learner, one_rank_group, next_step=1)
    assert json.loads((path / "manifest.json").read_text())["optimizer_stepped"] is False
    assert_loads_the_saved_weights(cfg, learner, path, saved)
    learner.policy.optimizer.step()  # zero gradients: Adam's state exists from here (the tests below)
    assert len(learner.policy.optimizer.state) > 0
    again = save_run_checkpoint(run_config(tmp_path / "stepped"), learner, one_rank_group, next_step=1)
    assert json.loads((again / "manifest.json").read_text())["optimizer_stepped"] is True


@contextmanager
def file_size_limit(limit_bytes: int):
    """Writes past `limit_bytes` of any file fail with EFBIG, in this process and those it forks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the write's signal kills the writer
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@pytest.mark.integration  # megatron's checkpoint writer forks its writer processes
def test_a_save_the_file_system_refuses_leaves_the_previous_checkpoint_loadable(learner, one_rank_group, tmp_path):
    cfg = run_config(tmp_path)
    saved = weights(learner)
    first = save_run_checkpoint(cfg, learner, one_rank_group, next_step=1)
    limit = min(p.stat().st_size for p in (first / "dist").glob("*.distcp")) // 2  # half of every shard file
    with file_size_limit(limit), pytest.raises(CheckpointSaveError) as e:
        save_run_checkpoint(cfg, learner, one_rank_group, next_step=2)
    # torch.save's zip writer (megatron's common.pt and shards) reports a short write as "unexpected pos"
    assert re.search(rf"could not save checkpoint {checkpoint_root(cfg)}/step_000002 \(step 2\): (OSError: \[Errno 27\] "
                     r"File too large|RuntimeError: .*unexpected pos \d+ vs \d+); its partial files were removed and "
                     rf"the previous checkpoint, {first} \(step 1\), is intact", str(e.value)), str(e.value)
    assert sorted(p.name for p in checkpoint_root(cfg).iterdir()) == ["latest", "step_000001"]
    latest = latest_checkpoint(cfg)
    assert latest is not None
    assert_loads_the_saved_weights(cfg, learner, latest, saved)


MS_RDONLY, MS_REMOUNT = 1, 32  # <sys/mount.h>


@contextmanager
def tmpfs(path: Path, size_bytes: int):
    """A tmpfs of `size_bytes` mounted at `path` (mount(2) in this process; needs CAP_SYS_ADMIN)."""
    libc = ctypes.CDLL(None, use_errno=True)
    path.mkdir()
    if libc.mount(b"tmpfs", bytes(path), b"tmpfs", 0, f"size={size_bytes}".encode()) != 0:
        pytest.skip(f"cannot mount a tmpfs here ({os.strerror(ctypes.get_errno())}); the file-size-limit test covers "
                    "a refused write")
    try:
        yield lambda: libc.mount(b"tmpfs", bytes(path), b"tmpfs", MS_REMOUNT | MS_RDONLY, None) == 0 or pytest.fail(
            f"remount read-only: {os.strerror(ctypes.get_errno())}")
    finally:
        libc.umount2(bytes(path), 2)  # MNT_DETACH


@pytest.mark.integration  # as above
def test_a_full_disk_and_then_a_read_only_one_leave_the_previous_checkpoint_loadable(learner, one_rank_group, tmp_path):
    saved = weights(learner)
    probe = save_run_checkpoint(run_config(tmp_path / "probe"), learner, one_rank_group, next_step=1)
    size = sum(p.stat().st_size for p in probe.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", size_bytes=size * 3 // 2) as make_read_only:  # room for one checkpoint, not two
        cfg = run_config(tmp_path / "disk")
        first = save_run_checkpoint(cfg, learner, one_rank_group, next_step=1)
        with pytest.raises(CheckpointSaveError, match=r"(No space left on device|unexpected pos).* the previous "
                                                      r"checkpoint, .*step_000001 \(step 1\), is intact"):
            save_run_checkpoint(cfg, learner, one_rank_group, next_step=2)
        assert sorted(p.name for p in checkpoint_root(cfg).iterdir()) == ["latest", "step_000001"]
        make_read_only()
        with pytest.raises(CheckpointSaveError, match=r"Read-only file system.* the previous checkpoint, .*step_000001"):
            save_run_checkpoint(cfg, learner, one_rank_group, next_step=2)
        assert latest_checkpoint(cfg) == first
        assert_loads_the_saved_weights(cfg, learner, first, saved)
