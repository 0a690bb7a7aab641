"""GPU benchmark for one H200 (<= 8 minutes): learner MFU, vLLM tokens/s, weight-sync seconds and
the async/sync speedup, for a ~0.76B-parameter LLaMA built in code (random init; no downloads).

    bash tools/gpu_bench.sh                       # prints one JSON summary line; details in runs/gpu_bench/
    GPU_BENCH_SMOKE=1 bash tools/gpu_bench.sh     # same code path on CPU with a tiny model (numbers meaningless)

NOT RUN YET: written on a CPU-only machine (no GPU was available to this task); the code path was
exercised only by the CPU smoke mode. Treat its first GPU run as its test.

Phases (each a subprocess with its own deadline, so one slow phase cannot eat the others' time):
1. build: `build_tiny_llama` with TinyLlamaSpec(hidden 2048, 16 layers, 16 heads / 8 KV heads,
   intermediate 5632) and the in-code BPE tokenizer (vocab ~1k, so the LM head is small: the
   parameter count is almost all transformer blocks).
2. micro (one process, learner and one vLLM replica on the same GPU):
   - learner MFU: megatron-core learner (TP=1, bf16, `build_optimizer`), `train_step` on
     `--rows` x `--seq` tokens of NLL (Best-of-K SFT loss path), 2 warm-up + `--steps` timed;
     model FLOPs per token = 6 * parameters + 12 * layers * hidden * seq (attention scores and
     values, fwd + bwd, no recompute); MFU = FLOPs/s / 989.4e12 (H100/H200 SXM dense bf16 peak).
   - vLLM tokens/s: `ReplicaPool.generate` of 256 prompts x n=4 x 256 tokens (ignore_eos), bf16,
     enforce_eager as the trainer runs it (ReplicaSpec default).
   - sync seconds: `WeightSender.push` of the learner's weights (TP gather -> HF names -> 512 MB
     buckets -> replica's in-place reload), 3 versions.
3. async: `megatron-async bench async` on the same model (sft.steps=0, online_dpo, 5 steps,
   64 prompts x K=4 x 256 tokens, max_lag 0 vs 1, one seed). NOTE: with one GPU the learner and
   the replica SHARE it, unlike the paper's separate GPUs: this speedup measures overlap by
   time-sharing one device, and is expected to be well below the separate-device ideal.
   If the trainer's GPU placement rules (placement.*) refuse learner and replica on the same GPU,
   this phase records the refusal as "async_error" in the summary and the other figures stand;
   on a 2-GPU machine pass the placement overrides instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK_BF16_FLOPS = 989.4e12  # H100/H200 SXM, dense bf16
SMOKE = os.environ.get("GPU_BENCH_SMOKE") == "1"


def spec():
    from megatron_async.models.tiny import TinyLlamaSpec

    if SMOKE:
        return TinyLlamaSpec(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, max_position_embeddings=1024)
    return TinyLlamaSpec(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, max_position_embeddings=2048)


def build(out: Path) -> dict:
    from megatron_async.data import load_problems
    from megatron_async.models.tiny import build_tiny_llama, build_tokenizer

    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        corpus = [f"{p.question}\n{p.solution}" for p in load_problems("synthetic", "train", 4000, 0)]
        tok = build_tokenizer(corpus, out / "tokenizer", vocab_size=1024)
        build_tiny_llama(model_dir, tok, spec(), seed=0)
    cfg = json.loads((model_dir / "config.json").read_text())
    return {"model_dir": str(model_dir), "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
            "vocab": cfg["vocab_size"]}


def micro(args) -> dict:
    import torch

    from megatron_async import algorithms

    from megatron_async.algorithms import batching
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from megatron_async.learner.parallel import init_parallel
    from megatron_async.rollout import ReplicaPool, ReplicaSpec, Sampling
    from megatron_async.learner.mapping import iter_hf_weights, load_hf_weights
    from megatron_async.weights.sync import WeightSender

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model_dir = Path(args.model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    layout = init_parallel(1, 1, seed=0)
    dtype = torch.bfloat16 if cuda else torch.float32
    chunks = build_model(model_dir, dtype=dtype)
    load_hf_weights(chunks, model_dir)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    policy, optimizer, scheduler = build_optimizer(chunks, OptimSettings(lr=1e-5))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.rows):
        ids = torch.randint(3, hf["vocab_size"], (args.seq,), generator=g).tolist()
        rows.append(batching.Sample(prompt_index=i, prompt_ids=ids[:64], completion_ids=ids[64:], logprobs=None,
                                    reward=1.0, version=0))
    mbs = algorithms.build_microbatches("best_of_k_sft", rows, 0, args.micro_batch, k=1, beta=0.0)
    loss_fn = algorithms.make_loss_fn("best_of_k_sft", beta=0.0)
    for _ in range(2):
        train_step(policy, optimizer, scheduler, mbs, loss_fn)
    sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        train_step(policy, optimizer, scheduler, mbs, loss_fn)
    sync()
    step_s = (time.perf_counter() - t) / args.steps
    tokens = args.rows * args.seq
    flops_per_token = 6 * params + 12 * hf["num_hidden_layers"] * hf["hidden_size"] * args.seq
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "parameters": params,
           "learner": {"tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
                       "model_tflops_per_s": flops_per_token * tokens / step_s / 1e12,
                       "mfu": flops_per_token * tokens / step_s / PEAK_BF16_FLOPS if cuda else None}}
    print(json.dumps(out), flush=True)

    spec = ReplicaSpec(model=str(model_dir), dtype="bfloat16" if cuda else "float32", max_model_len=1024,
                       kv_cache_bytes=(16 << 30) if cuda else (256 << 20), seed=0)
    from megatron_async.rollout.build import replica_env

    with ReplicaPool(spec, 1, log_dir=Path(args.out) / "replica_logs", env=replica_env(),
                     start_timeout_s=240) as pool:
        prompts = [torch.randint(3, hf["vocab_size"], (64,), generator=g).tolist() for _ in range(args.prompts)]
        pool.generate(prompts[:4], Sampling(max_tokens=8))  # warm-up
        sampling = Sampling(n=4, max_tokens=args.gen_tokens, ignore_eos=True, seed=0, logprobs=True)
        t = time.perf_counter()
        records = pool.generate(prompts, sampling)
        gen_s = time.perf_counter() - t
        n_tok = sum(len(r.token_ids) for r in records)
        out["vllm"] = {"prompts": len(prompts), "n": 4, "max_tokens": args.gen_tokens, "tokens": n_tok,
                       "seconds": gen_s, "tokens_per_s": n_tok / gen_s, "enforce_eager": spec.enforce_eager}
        syncs = []
        with WeightSender(pool.addresses, pool.authkey, timeout_s=300, bucket_bytes=512 << 20) as sender:
            for version in range(1, 4):
                t = time.perf_counter()
                m = sender.push(version, layout.pp_rank, layout.pp, iter_hf_weights([c.module for c in policy]))
                syncs.append({"seconds": time.perf_counter() - t, "gb_per_s": m["gb_per_s"], "bytes": m["bytes"]})
        out["sync"] = {"per_update": syncs, "seconds_mean": sum(s["seconds"] for s in syncs) / len(syncs)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", nargs="?", default="all", choices=["all", "micro"])
    p.add_argument("--out", default=str(REPO / "runs" / ("gpu_bench_smoke" if SMOKE else "gpu_bench")))
    p.add_argument("--model-dir", default=None)
    p.add_argument("--rows", type=int, default=4 if SMOKE else 32)
    p.add_argument("--seq", type=int, default=128 if SMOKE else 1024)
    p.add_argument("--micro-batch", type=int, default=4 if SMOKE else 4)
    p.add_argument("--steps", type=int, default=2 if SMOKE else 5)
    p.add_argument("--prompts", type=int, default=4 if SMOKE else 256)
    p.add_argument("--gen-tokens", type=int, default=16 if SMOKE else 256)
    p.add_argument("--budget-s", type=float, default=470.0, help="whole script (the issue allows 8 minutes)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "micro":
        res = micro(args)
        (out / "micro.json").write_text(json.dumps(res, indent=1))
        return 0

    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    summary: dict = {"smoke_cpu": SMOKE, "build": build(out)}
    model_dir = summary["build"]["model_dir"]
    cmd = [sys.executable, __file__, "micro", "--out", str(out), "--model-dir", model_dir,
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("rows", "seq", "micro_batch", "steps",
                                                                      "prompts", "gen_tokens")]]
    try:
        subprocess.run(cmd, check=True, timeout=max(30.0, min(240.0, left() - 150)))
        summary.update(json.loads((out / "micro.json").read_text()))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        summary["micro_error"] = str(e)
    bench = [sys.executable, "-m", "megatron_async", "bench", "async", str(REPO / "configs" / "cpu_tiny.yaml"),
             f"model.hf_path={model_dir}", "sft.steps=0", "trainer.steps=5", "data.eval_size=8",
             "trainer.micro_batch_size=8", "rollout.k=4",
             *(["rollout.prompts_per_step=8", "rollout.max_new_tokens=16", "rollout.kv_cache_gib=0.25"] if SMOKE else
               ["rollout.prompts_per_step=64", "rollout.max_new_tokens=256", "rollout.kv_cache_gib=16",
                "model.dtype=bfloat16"]),
             "--seeds", "1", "--pin", "none", "--out-dir", str(out / "async")]
    try:
        subprocess.run(bench, check=True, timeout=max(30.0, left() - 5), cwd=REPO)
        res = json.loads((out / "async" / "bench_async.json").read_text())
        summary["async"] = {k: res["summary"][k] for k in ("speedup", "ideal", "efficiency", "sync_mean_generation_s",
                                                          "sync_mean_train_s", "sync_mean_weight_sync_s")}
        summary["async"]["command"] = " ".join(bench)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        summary["async_error"] = str(e)
    summary["seconds"] = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
