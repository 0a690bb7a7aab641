"""`megatron-async bench checkpoint`: what a run checkpoint costs the learner, sync against async,
and what hashing and verifying it cost, one core against the threads of `learner/checkpoint.py`.

    megatron-async bench checkpoint [--models tiny smollm2] [--steps 6] [--out-dir runs/bench_checkpoint]

Per model, one process (one learner rank, as `bench learner` builds it: `LearnerState` from the
main job's config, synthetic batches) runs `--steps` learner steps per mode, `sync` and `async`
(trainer.async_save), saving a run checkpoint after the middle one (`RunCheckpoints.save`, then
`poll` at every step boundary as the trainer does). Reported per mode: the median plain step, the
saving step (its learner step + the save call), the steps after it until the save was complete
(an async save's writer shares the CPUs with them), the seconds the save call held the learner,
and the seconds from the save call until `latest` named it (async: the boundary that found it done). Then, on that checkpoint: sha256 of every file by one thread (what rank 0 did
for every rank before checkpoints were hashed by their writers, on save and again on verify) against `file_digests`' threads,
and `check_files` (the preflight's and the load's verification) in threads. Writes
`bench_checkpoint.json`. Timings are never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_async.bench.learner import CONFIGS, PROMPT_TOKENS, model_dir_for, synthetic_batch
from megatron_async.cluster.cpu_affinity import cpu_flags
from megatron_async.config import load_config
from megatron_async.io_utils import atomic_write_text
from megatron_async.learner.checkpoint import HASH_THREADS, MANIFEST, sha256_file, check_files, file_digests
from megatron_async.learner.parallel import init_parallel
from megatron_async.models.base_model import load_tokenizer
from megatron_async.run.checkpoint import RunCheckpoints, latest_checkpoint
from megatron_async.run.learner_state import LearnerState
from megatron_async.run_plan import build_plan


def run_mode(cfg, learner: LearnerState, ctrl, batches: list, asynchronous: bool) -> dict:
    """`len(batches)` steps with a save after the middle one; the seconds of each, and of the save."""
    checkpoints = RunCheckpoints(cfg, learner, ctrl, asynchronous)
    save_at, steps, saved_at, completed_s = len(batches) // 2, [], 0.0, None
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        checkpoints.poll()
        if completed_s is None and saved_at and checkpoints.pending is None:
            completed_s = start - saved_at  # seen complete at this boundary
        learner.step(batch, step=i, updates=cfg.trainer.updates_per_batch)
        if i == save_at:
            saved_at = time.perf_counter()
            path = checkpoints.save(next_step=i + 1)
            save_call_s = time.perf_counter() - saved_at
        steps.append(time.perf_counter() - start)
    if completed_s is None:
        checkpoints.wait()
        completed_s = time.perf_counter() - saved_at
    assert latest_checkpoint(cfg) == path
    plain = [s for i, s in enumerate(steps) if i not in (0, save_at)]  # step 0 warms up
    return {"plain_step_s": statistics.median(plain), "saving_step_s": steps[save_at], "save_call_s": save_call_s,
            "steps_s": steps, "save_to_latest_s": completed_s, "checkpoint": str(path)}


def integrity(path: Path) -> dict:
    """One thread hashing every file (before) against the threads (after), and the verification."""
    files = [p for p in sorted(path.rglob("*")) if p.is_file() and p != path / MANIFEST]
    start = time.perf_counter()
    for p in files:
        sha256_file(p)
    serial = time.perf_counter() - start
    start = time.perf_counter()
    file_digests(path, files)
    threaded = time.perf_counter() - start
    start = time.perf_counter()
    check_files(path, json.loads((path / MANIFEST).read_text()))
    verify = time.perf_counter() - start
    return {"bytes": sum(p.stat().st_size for p in files), "files": len(files), "largest_file_bytes":
            max(p.stat().st_size for p in files), "hash_one_thread_s": serial, "hash_threads_s": threaded,
            "verify_threads_s": verify, "threads": HASH_THREADS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-async bench checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=sorted(CONFIGS))
    p.add_argument("--steps", type=int, default=6, help="learner steps per mode (a save after the middle one)")
    p.add_argument("--smollm2-dir", default=None, help="an exported SmolLM2-135M-Instruct (default: export one)")
    p.add_argument("--out-dir", default="runs/bench_checkpoint")
    args = p.parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = init_parallel(1, 1, seed=0)
    ctrl = dist.new_group(backend="gloo")
    report: dict[str, Any] = {
        "command": "megatron-async bench checkpoint " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch_threads": torch.get_num_threads(),
        "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "sha_ni"}),
        "load_avg_start": os.getloadavg(), "cases": []}
    for model in args.models:
        model_dir, overrides = model_dir_for(model, out_dir, args.smollm2_dir)
        tokenizer = load_tokenizer(model_dir)
        for mode in ("sync", "async"):
            cfg = load_config(CONFIGS[model], [*overrides, f"run.out_dir={out_dir}", f"run.name={model}_{mode}"])
            learner = LearnerState.build(cfg, build_plan(cfg), model_dir, layout, tokenizer.pad_token_id)
            batches = [synthetic_batch(len(tokenizer), cfg.rollout.prompts_per_step, cfg.rollout.k,
                                       PROMPT_TOKENS[model], cfg.rollout.max_new_tokens, seed) for seed in range(args.steps)]
            case = {"model": model, "mode": mode, **run_mode(cfg, learner, ctrl, batches, asynchronous=mode == "async")}
            case.update(integrity(Path(case["checkpoint"])))
            report["cases"].append(case)
            print(f"{model:8s} {mode:5s}: plain step {case['plain_step_s']:.3f} s, saving step {case['saving_step_s']:.3f} s, "
                  f"save call {case['save_call_s']:.3f} s, save to latest {case['save_to_latest_s']:.3f} s; "
                  f"{case['bytes'] / 2**20:.0f} MiB in {case['files']} files: sha256 one thread {case['hash_one_thread_s']:.3f} s, {case['threads']} threads "
                  f"{case['hash_threads_s']:.3f} s, verify {case['verify_threads_s']:.3f} s", flush=True)
    report["load_avg_end"] = os.getloadavg()
    atomic_write_text(out_dir / "bench_checkpoint.json", json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'bench_checkpoint.json'}")
    return 0
