"""Atomic, verified learner checkpoints with megatron `dist_checkpointing`.

A checkpoint directory holds:
    dist/            megatron sharded checkpoint (model, and optimizer + scheduler when given);
                     resharding-friendly: saved at one TP x PP, loadable at any other
    hf_config.json   the HF config the model was built from (for conversion back to HF)
    manifest.json    architecture, layout and parameter dtype at save time, `extra` user metadata,
                     sha256 and size of every file
    <part>/          optional complete checkpoints of other models (e.g. PPO's `value/`), moved in
                     before the manifest, so they are checksummed and made visible with this one

Saving is atomic: every rank writes into `<dir>.tmp` (removed first if a crashed save left it)
through megatron's fully parallel save (replicated tensors spread over the data-parallel ranks),
hashes the files it wrote itself (sha256, in threads, right after writing them: `_hashing_writer`),
and rank 0 gathers those digests into the manifest (hashing only its own small files: common.pt,
megatron's metadata, `files`), checks that every listed file is there at its size, and renames the
tmp dir into place (an existing checkpoint at `dir` is replaced only after the new one is
complete). No rank reads another's files. `begin_checkpoint` returns that save as megatron's
`AsyncRequest`: run now (`execute_sync`, what `save_checkpoint` does) or in a background process
(`AsyncCallsQueue`, run/checkpoint.py), its finalize functions making it visible.
Loading verifies sizes and checksums (each rank a share of the files, `verify_collectively`) and
refuses a checkpoint of another architecture with a message naming the fields, and optimizer state saved at another parameter dtype (fp32's `FP32Optimizer` state has no fp32 main
weights for bf16's mixed-precision optimizer to resume from, and bf16's would be dropped).
An optimizer that has not stepped yet (Online DPO's first batches may form no pair) holds no Adam
moments, and megatron's load would ask for them (KeyError optimizer.state.exp_avg...): its
checkpoint saves model and schedule only (`optimizer_stepped: false` in the manifest), and the
load gives the fresh optimizer the loaded weights (`reload_model_params`: bf16's fp32 main copies).
All ranks must see the same filesystem (one node, or a shared one). Call collectively.

NOTE megatron's torch_dist writer returns its write processes' results through a queue it creates
at the first save, `multiprocessing.Manager().Queue()`: a server process, spawned, in the job's
process group, so a stop signal sent to the whole job (`timeout`, `kill -TERM -PGID`, SLURM) killed
it and every later save failed with BrokenPipeError. The queue must cross processes (a background
save's writer is a forked process), so `_results_queue_that_outlives_a_stop_signal` starts that
server itself, the same way, with SIGTERM and SIGUSR1 blocked in it (run/stop.py's STOP_SIGNALS:
the rank decides when to stop; a SIGKILL or the rank's exit still ends the server).
"""
from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_async.io_utils import replace_dir
from megatron_async.learner.model import LearnerModel, LlamaArch, unwrap_model as _unwrap

if TYPE_CHECKING:  # megatron is imported where it is used, as in the rest of the learner
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

MANIFEST = "manifest.json"
FORMAT = "megatron_async/1"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # run/stop.py's, which the learner does not import


DIGESTS = "rank_digests"  # in `<dir>.tmp` only: each rank's digests of the files it wrote, for rank 0
HASH_THREADS = os.cpu_count() or 1  # hashlib releases the GIL while it hashes: one file per thread


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(root: Path, paths: list[Path]) -> dict[str, dict]:
    """{name relative to root: {"sha256", "bytes"}} of `paths`, hashed in parallel threads."""
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(paths)))) as pool:
        digests = list(pool.map(sha256_file, paths))
    return {str(p.relative_to(root)): {"sha256": d, "bytes": p.stat().st_size} for p, d in zip(paths, digests)}


def _checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` but the manifest (what an older manifest's "files" holds)."""
    paths = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST]
    return {name: d["sha256"] for name, d in file_digests(root, paths).items()}


def check_files(ckpt_dir: Path, manifest: dict, names: list[str] | None = None, contents: bool = True) -> None:
    """The manifest's files `names` (None: all) are there at their recorded size (older manifests
    record none) and, with `contents`, match their sha256 (hashed in threads). Raises
    ValueError naming the checkpoint and the first bad file."""
    sizes = manifest.get("sizes", {})
    names = sorted(manifest["files"] if names is None else names)
    for name in names:
        path = ckpt_dir / name
        if not path.is_file():
            raise ValueError(f"checkpoint {ckpt_dir}: file {name} listed in the manifest is missing")
        if name in sizes and path.stat().st_size != sizes[name]:
            raise ValueError(f"checkpoint {ckpt_dir}: file {name} is corrupt ({path.stat().st_size} bytes, "
                             f"the manifest says {sizes[name]})")
    if not contents:
        return
    found = file_digests(ckpt_dir, [ckpt_dir / n for n in names])
    for name in names:
        if found[name]["sha256"] != manifest["files"][name]:
            raise ValueError(f"checkpoint {ckpt_dir}: file {name} is corrupt (sha256 differs from the manifest)")


def file_share(manifest: dict, rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` hashes to verify a checkpoint: the manifest's files dealt
    largest first to the rank with the fewest bytes so far (the same split on every rank)."""
    sizes = manifest.get("sizes", {})
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(manifest["files"], key=lambda n: (-sizes.get(n, 1), n)):
        least = load.index(min(load))
        shares[least].append(name)
        load[least] += sizes.get(name, 1)
    return shares[rank]


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


T = TypeVar("T")


def rank0_then_share(fn: Callable[[], T]) -> T:
    """Run fn on rank 0, give its result (or its exception, re-raised) to every rank."""
    box: list[Any] = [None]
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


def _results_queue_that_outlives_a_stop_signal() -> None:
    """Give megatron's torch_dist writer its results queue before megatron makes one (module NOTE)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # a megatron-core whose writer changed: look again
        raise RuntimeError("megatron.core.dist_checkpointing.strategies.filesystem_async has no _results_queue")
    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # megatron's own choice of server
        manager.start(initializer=functools.partial(signal.pthread_sigmask, signal.SIG_BLOCK, STOP_SIGNALS))
        filesystem_async._results_queue = manager.Queue()


def begin_checkpoint(ckpt_dir: str | os.PathLike, model: LearnerModel, optimizer=None, scheduler=None,
                     extra: dict | None = None, files: dict[str, Path] | None = None,
                     parts: dict[str, Path] | None = None) -> AsyncRequest:
    """Start saving model (+ optimizer, scheduler) to `ckpt_dir` atomically; all ranks. What it
    returns writes the shards and makes the checkpoint visible: `.execute_sync()`, or schedule it on
    megatron's `AsyncCallsQueue` (the writing in a forked process; the queue runs the finalize
    functions on all ranks once every rank's writer is done). `extra`: JSON-able metadata (step,
    policy version, data position...) returned by `load_checkpoint`. `files`: more files to copy in
    (relative name -> source path, read when the save finishes), e.g. tokenizer files. `parts`:
    finished checkpoint directories (name -> path, on the same filesystem) MOVED in by rename, e.g.
    another model saved just before with `save_checkpoint`; load one with
    `load_checkpoint(ckpt_dir / name, ...)`."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    layout = _layout()
    my_digests = tmp / DIGESTS / f"rank_{dist.get_rank():05d}.json"

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
        (tmp / DIGESTS).mkdir()

    rank0_then_share(prepare)
    stepped = optimizer is not None and _optimizer_stepped(optimizer, model)
    _results_queue_that_outlives_a_stop_signal()
    request = dist_checkpointing.save(
        _sharded_state(model.chunks, optimizer if stepped else None, scheduler, loading=False), str(tmp / "dist"),
        sharded_strategy=_fully_parallel_save(), async_sharded_save=True)
    if request.async_fn is not None:  # None: this rank writes no shard
        request = request._replace(async_fn=_hashing_writer(request.async_fn, tmp, my_digests))

    def finish():  # all ranks, after every rank's writer is done and megatron wrote its metadata
        mine = json.loads(my_digests.read_text()) if my_digests.exists() else {}
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        rank0_then_share(lambda: _write_manifest(tmp, ckpt_dir, everyone, model, layout, optimizer is not None,
                                                 stepped, extra, files, parts))

    request.add_finalize_fn(finish)
    return request


def save_checkpoint(ckpt_dir: str | os.PathLike, model: LearnerModel, optimizer=None, scheduler=None,
                    extra: dict | None = None, files: dict[str, Path] | None = None,
                    parts: dict[str, Path] | None = None) -> Path:
    """`begin_checkpoint`, run to the end before returning (`ckpt_dir`, complete)."""
    begin_checkpoint(ckpt_dir, model, optimizer, scheduler, extra, files, parts).execute_sync()
    return Path(ckpt_dir)


def _fully_parallel_save():
    """megatron's default save strategy, spreading the replicated tensors' writing over the
    data-parallel ranks (each writes a share instead of DP rank 0 writing them all)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            ps.get_data_parallel_group(with_context_parallel=True))


def _hashing_writer(write, root: Path, out: Path):
    """megatron's writer function (`FileSystemWriterAsync.write_preloaded_data_multiproc(rank,
    write_buckets, results_queue)`), followed by the sha256 and size of the files it wrote
    (each bucket's first field is its file's path), saved to `out` for `begin_checkpoint`'s finish.
    Runs where the writer runs: in the background process of an asynchronous save."""
    def write_then_hash(rank, buckets, results_queue):
        write(rank, buckets, results_queue)
        written = [Path(bucket[0]) for bucket in buckets if Path(bucket[0]).exists()]  # none when the write failed
        out.write_text(json.dumps(file_digests(root, written)))
    return write_then_hash


def _write_manifest(tmp: Path, ckpt_dir: Path, ranks_digests: list[dict], model: LearnerModel, layout: dict,
                    has_optimizer: bool, stepped: bool, extra: dict | None, files: dict[str, Path] | None,
                    parts: dict[str, Path] | None) -> None:
    """Rank 0: put `files` and `parts` in, write the manifest from the ranks' digests (hashing only
    what no rank did: its own small files; a part's come from its manifest), check that every file
    is there at its size, and rename the checkpoint into place."""
    shutil.rmtree(tmp / DIGESTS)
    for name, src in (files or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tmp / name)
    digests = {name: d for ranks in ranks_digests for name, d in ranks.items()}
    for name, src in (parts or {}).items():
        os.replace(src, tmp / name)
        part = json.loads((tmp / name / MANIFEST).read_text())
        digests.update({f"{name}/{f}": {"sha256": h, "bytes": part["sizes"][f]} for f, h in part["files"].items()})
    if model.hf_config is not None:
        (tmp / "hf_config.json").write_text(json.dumps(model.hf_config, indent=2))
    rest = [p for p in sorted(tmp.rglob("*")) if p.is_file() and p != tmp / MANIFEST]
    digests.update(file_digests(tmp, [p for p in rest if str(p.relative_to(tmp)) not in digests]))
    manifest = {
        "format": FORMAT,
        "arch": model.arch.to_dict(),
        "saved_with": layout,
        "has_optimizer": has_optimizer,
        "optimizer_stepped": stepped,  # False: no Adam state yet, none saved (module docstring)
        "dtype": _param_dtype(model),
        "extra": extra or {},
        "files": {name: digests[name]["sha256"] for name in sorted(digests)},
        "sizes": {name: digests[name]["bytes"] for name in sorted(digests)},
    }
    check_files(tmp, manifest, contents=False)  # all there, at their sizes: complete before it becomes visible
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    replace_dir(tmp, ckpt_dir)


def read_manifest(ckpt_dir: str | os.PathLike, verify: bool = True, share: tuple[int, int] = (0, 1)) -> dict:
    """The checkpoint's manifest; with `verify`, first check the files against their size and sha256
    (`check_files`): all of them, or with `share` = (rank, world) the ones `file_share` gives that
    rank. Raises FileNotFoundError / ValueError naming the checkpoint and the file."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint: {MANIFEST} is missing")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if verify:
        check_files(ckpt_dir, manifest, file_share(manifest, *share))
    return manifest


def verify_collectively(ckpt_dir: Path) -> dict:
    """All ranks: the manifest (read by rank 0), each rank checking its `file_share` of the files
    in parallel; any rank's problem is raised as a ValueError on every rank."""
    manifest = rank0_then_share(lambda: read_manifest(ckpt_dir, verify=False))
    try:
        check_files(ckpt_dir, manifest, file_share(manifest, dist.get_rank(), dist.get_world_size()))
        problem = None
    except ValueError as e:
        problem = str(e)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if found := next((p for p in problems if p is not None), None):
        raise ValueError(found)
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
    manifest = verify_collectively(ckpt_dir)
    check_arch(manifest, model.arch, str(ckpt_dir))
    if optimizer is not None and not manifest["has_optimizer"]:
        raise ValueError(f"checkpoint {ckpt_dir} has no optimizer state (saved model-only, e.g. by convert)")
    saved_dtype = manifest.get("dtype")  # absent in older manifests: fp32 on CPU, bf16 on GPU
    if optimizer is not None and saved_dtype is not None and saved_dtype != _param_dtype(model):
        raise ValueError(f"checkpoint {ckpt_dir} was trained in {saved_dtype}, this learner is {_param_dtype(model)}: "
                         f"resume with model.dtype={saved_dtype}, or start a new run from its weights")
    stepped = manifest.get("optimizer_stepped", True)  # absent in older manifests: always saved
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
