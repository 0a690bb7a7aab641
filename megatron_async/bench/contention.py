"""Contention between generation and training on one machine: each alone vs both together.

    .venv/bin/python -m megatron_async.bench.contention MODEL_DIR --learner-cpus 0 --replica-cpus 1 \
        --seconds 20 --out contention.json

Three phases of `--seconds` each, in one process pinned like a learner (parallel.learner_cpus):
generation alone (a real vLLM replica through `ReplicaPool`, pinned by rollout.replica_cpus, fixed
prompts x n x max_tokens with ignore_eos), training alone (fp32 AdamW steps of the same model as a
plain torch `LlamaForCausalLM` on a fixed batch: the learner's compute without megatron's set-up,
which `bench learner` finds at about the speed of megatron-core's step on CPU), then both at once
(generation loop in a thread: it only waits on the replica's socket). contention = 1 - rate
together / rate alone, per side. The paper's analogue is the GIL overhead of running vLLM in the
learner's process; here generation is another process and the cost is shared cores/memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from megatron_async.bench.report import contention
from megatron_async.cluster.cpu_affinity import pin_learner, replica_pin_env
from megatron_async.io_utils import atomic_write_text
from megatron_async.rollout import ReplicaPool, ReplicaSpec, Sampling


def _gen_loop(pool, prompts, sampling, seconds: float, out: dict) -> None:
    tokens, calls, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += sum(len(r.token_ids) for r in pool.generate(prompts, sampling))
        calls += 1
    out.update(tokens=tokens, calls=calls, seconds=time.perf_counter() - t0)


def _train_loop(model, opt, batch, seconds: float, out: dict) -> None:
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    out.update(steps=steps, seconds=time.perf_counter() - t0)


def measure(model_dir: Path, learner_cpus: str, replica_cpus: str, seconds: float, log_dir: Path) -> dict:
    mine = pin_learner(learner_cpus)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    batch = torch.randint(3, vocab, (16, 96))
    prompts = [list(range(3 + i, 19 + i)) for i in range(16)]
    sampling = Sampling(n=4, max_tokens=32, ignore_eos=True, seed=0)
    spec = ReplicaSpec(model=str(model_dir), kv_cache_bytes=256 << 20, max_model_len=256)
    env = replica_pin_env(replica_cpus)
    result: dict[str, Any] = {"learner_cpus": learner_cpus, "replica_cpus": replica_cpus, "learner_pinned_to": mine,
              "seconds_per_phase": seconds, "train_batch": list(batch.shape),
              "generation": {"prompts": len(prompts), "n": sampling.n, "max_tokens": sampling.max_tokens}}
    with ReplicaPool(spec, 1, log_dir=log_dir, env=env) as pool:
        pool.generate(prompts[:2], Sampling(max_tokens=4))  # warm-up
        _train_loop(model, opt, batch, 1.0, {})  # warm-up
        gen_alone: dict[str, float] = {}
        train_alone: dict[str, float] = {}
        gen_tog: dict[str, float] = {}
        train_tog: dict[str, float] = {}
        load = [os.getloadavg()[0]]
        _gen_loop(pool, prompts, sampling, seconds, gen_alone)
        load.append(os.getloadavg()[0])
        _train_loop(model, opt, batch, seconds, train_alone)
        load.append(os.getloadavg()[0])
        thread = threading.Thread(target=_gen_loop, args=(pool, prompts, sampling, seconds, gen_tog))
        thread.start()
        _train_loop(model, opt, batch, seconds, train_tog)
        thread.join()
        load.append(os.getloadavg()[0])
    rate = lambda d, k: d[k] / d["seconds"]  # noqa: E731
    result.update({
        "generation_tokens_per_s_alone": rate(gen_alone, "tokens"),
        "generation_tokens_per_s_together": rate(gen_tog, "tokens"),
        "train_steps_per_s_alone": rate(train_alone, "steps"),
        "train_steps_per_s_together": rate(train_tog, "steps"),
        "load_avg_1min_at_phase_starts_and_end": load,
    })
    result["contention_generation"] = contention(result["generation_tokens_per_s_alone"],
                                                 result["generation_tokens_per_s_together"])
    result["contention_train"] = contention(result["train_steps_per_s_alone"], result["train_steps_per_s_together"])
    return result


def run_contention(model_dir: Path, learner_cpus: str, replica_cpus: str, seconds: float, out_dir: Path,
                   also_unpinned: bool = True) -> list[dict]:
    """Measure in fresh subprocesses (pinning must not leak into the caller): configured layout,
    and unpinned too when the configured one is pinned."""
    layouts = [(str(learner_cpus), str(replica_cpus))]
    if also_unpinned and (str(learner_cpus) or str(replica_cpus)):
        layouts.append(("", ""))
    results = []
    for i, (lc, rc) in enumerate(layouts):
        out = out_dir / f"contention_{i}.json"
        print(f"contention: learner CPUs '{lc}', replica CPUs '{rc}': 3 phases x {seconds:.0f} s", flush=True)
        cmd = [sys.executable, "-m", "megatron_async.bench.contention", str(model_dir), "--learner-cpus", lc,
               "--replica-cpus", rc, "--seconds", str(seconds), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"contention measurement failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        results.append({"command": " ".join(cmd), **json.loads(out.read_text())})
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--learner-cpus", default="")
    p.add_argument("--replica-cpus", default="")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", default="contention.json")
    args = p.parse_args()
    res = measure(Path(args.model_dir), args.learner_cpus, args.replica_cpus, args.seconds,
                  Path(args.out).resolve().parent / "contention_replica_logs")
    atomic_write_text(args.out, json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
