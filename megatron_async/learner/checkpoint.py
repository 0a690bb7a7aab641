"""Atomic, verified learner checkpoints with megatron `dist_checkpointing`.

A checkpoint directory holds:
    dist/            megatron sharded checkpoint (model, and optimizer + scheduler when given);
                     resharding-friendly: saved at one TP x PP, loadable at any other
    hf_config.json   the HF config the model was built from (for conversion back to HF)
    manifest.json    architecture, layout and parameter dtype at save time, `extra` user metadata,
                     sha256 of every file
    <part>/          optional complete checkpoints of other models (e.g. PPO's `value/`), moved in
                     before the manifest, so they are checksummed and made visible with this one

Saving is atomic: every rank writes into `<dir>.tmp` (removed first if a crashed save left it),
rank 0 checksums the files, writes the manifest, and renames the tmp dir into place (an existing
checkpoint at `dir` is replaced only after the new one is complete). Loading verifies the
checksums and refuses a checkpoint of another architecture with a message naming the fields, and
optimizer state saved at another parameter dtype (fp32's `FP32Optimizer` state has no fp32 main
weights for bf16's mixed-precision optimizer to resume from, and bf16's would be dropped).
An optimizer that has not stepped yet (Online DPO's first batches may form no pair) holds no Adam
moments, and megatron's load would ask for them (KeyError optimizer.state.exp_avg...): its
checkpoint saves model and schedule only (`optimizer_stepped: false` in the manifest), and the
load gives the fresh optimizer the loaded weights (`reload_model_params`: bf16's fp32 main copies).
All ranks must see the same filesystem (one node, or a shared one). Call collectively.

NOTE megatron's torch_dist writer returns its write processes' results through a queue it creates
at the first save, `multiprocessing.Manager().Queue()`: a server process, spawned for megatron's
asynchronous save, where the writers report to another process. Ours are synchronous (the writers
report to the rank, which reads the queue itself), so `_results_in_this_process` swaps that one
queue for one of this process: no server exists that a stop signal sent to the whole job (`timeout`,
`kill -TERM -PGID`, SLURM) kills. Killed, it made every later save fail with BrokenPipeError.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_async.io_utils import replace_dir
from megatron_async.learner.model import LearnerModel, LlamaArch, unwrap_model as _unwrap

MANIFEST = "manifest.json"
FORMAT = "megatron_async/1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha256(p) for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _sharded_state(model_chunks, optimizer, scheduler, loading: bool) -> dict:
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline (several model chunks per rank) is not supported")
    state = {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=loading)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def rank0_then_share(fn):
    """Run fn on rank 0, give its result (or its exception, re-raised) to every rank."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box = [("err", e)]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "err":
        raise value
    return value


def _results_in_this_process() -> None:
    """Swap megatron's results queue of the torch_dist writer for one of this process (module NOTE)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # a megatron-core whose writer changed: look again
        raise RuntimeError("megatron.core.dist_checkpointing.strategies.filesystem_async has no _results_queue")
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(ckpt_dir: str | os.PathLike, model: LearnerModel, optimizer=None, scheduler=None,
                    extra: dict | None = None, files: dict[str, Path] | None = None,
                    parts: dict[str, Path] | None = None) -> Path:
    """Save model (+ optimizer, scheduler) to `ckpt_dir` atomically. `extra`: JSON-able metadata
    (step, policy version, data position...) returned by `load_checkpoint`. `files`: more files to
    copy in (relative name -> source path), e.g. tokenizer files; they are checksummed too.
    `parts`: finished checkpoint directories (name -> path, on the same filesystem) MOVED in by
    rename, e.g. another model saved just before with `save_checkpoint`; load one with
    `load_checkpoint(ckpt_dir / name, ...)`."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    layout = _layout()

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)

    rank0_then_share(prepare)
    stepped = optimizer is not None and _optimizer_stepped(optimizer, model)
    _results_in_this_process()
    dist_checkpointing.save(_sharded_state(model.chunks, optimizer if stepped else None, scheduler, loading=False),
                            str(tmp / "dist"))
    dist.barrier()

    def finish():
        for name, src in (files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / name)
        for name, src in (parts or {}).items():
            os.replace(src, tmp / name)
        if model.hf_config is not None:
            (tmp / "hf_config.json").write_text(json.dumps(model.hf_config, indent=2))
        manifest = {
            "format": FORMAT,
            "arch": model.arch.to_dict(),
            "saved_with": layout,
            "has_optimizer": optimizer is not None,
            "optimizer_stepped": stepped,  # False: no Adam state yet, none saved (module docstring)
            "dtype": _param_dtype(model),
            "extra": extra or {},
            "files": _checksums(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        replace_dir(tmp, ckpt_dir)

    rank0_then_share(finish)
    return ckpt_dir


def read_manifest(ckpt_dir: str | os.PathLike, verify: bool = True) -> dict:
    """The checkpoint's manifest; with `verify`, first check every file against its sha256.
    Raises FileNotFoundError / ValueError naming the checkpoint and the file."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint: {MANIFEST} is missing")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if verify:
        found = _checksums(ckpt_dir)
        for name, digest in manifest["files"].items():
            if name not in found:
                raise ValueError(f"checkpoint {ckpt_dir}: file {name} listed in the manifest is missing")
            if found[name] != digest:
                raise ValueError(f"checkpoint {ckpt_dir}: file {name} is corrupt (sha256 differs from the manifest)")
    return manifest


def check_arch(manifest: dict, arch: LlamaArch, where: str) -> None:
    """Raise ValueError if the checkpoint's architecture differs from `arch`, naming the fields."""
    saved = manifest["arch"]
    mine = json.loads(json.dumps(arch.to_dict()))  # tuples -> lists, as stored
    diff = {k: (saved.get(k), mine[k]) for k in mine if saved.get(k) != mine[k]}
    if diff:
        fields = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {where} holds another architecture than the model ({fields})")


def _optimizer_stepped(optimizer, model: LearnerModel) -> bool:
    """Whether megatron's optimizer holds Adam state on any rank (none before its first step)."""
    flag = torch.tensor([1 if len(optimizer.state) else 0], device=next(model.chunks[0].parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _param_dtype(model: LearnerModel) -> str:
    return str(next(model.chunks[0].parameters()).dtype).removeprefix("torch.")


def load_checkpoint(ckpt_dir: str | os.PathLike, model: LearnerModel, optimizer=None, scheduler=None) -> dict:
    """Load a checkpoint saved by `save_checkpoint` (at any TP x PP) into this layout's model
    chunks (+ optimizer, scheduler). Returns the saved `extra` metadata."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    manifest = rank0_then_share(lambda: read_manifest(ckpt_dir))
    check_arch(manifest, model.arch, str(ckpt_dir))
    if optimizer is not None and not manifest["has_optimizer"]:
        raise ValueError(f"checkpoint {ckpt_dir} has no optimizer state (saved model-only, e.g. by convert)")
    saved_dtype = manifest.get("dtype")  # absent before 2026-12-04: fp32 on CPU, bf16 on GPU
    if optimizer is not None and saved_dtype is not None and saved_dtype != _param_dtype(model):
        raise ValueError(f"checkpoint {ckpt_dir} was trained in {saved_dtype}, this learner is {_param_dtype(model)}: "
                         f"resume with model.dtype={saved_dtype}, or start a new run from its weights")
    stepped = manifest.get("optimizer_stepped", True)  # absent before 2026-12-04: always saved
    state = dist_checkpointing.load(_sharded_state(model.chunks, optimizer if stepped else None, scheduler, loading=True),
                                    str(ckpt_dir / "dist"))
    with torch.no_grad():
        _unwrap(model.chunks[0]).load_state_dict(state["model"])
        if optimizer is not None and stepped:
            optimizer.load_state_dict(state["optimizer"])
        elif optimizer is not None:
            optimizer.reload_model_params()  # a fresh optimizer = one that never stepped, on the loaded weights
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return manifest["extra"]
