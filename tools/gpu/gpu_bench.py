"""GPU benchmark for one H200 (<= 8 minutes): learner step time / tokens/s / MFU / memory by component,
vLLM tokens/s and weight-sync seconds, and (with >= 2 GPUs) the async/sync speedup.

    bash tools/gpu/gpu_bench.sh                     # all phases; summary in runs/gpu_bench/summary.json
    python tools/gpu/gpu_bench.py learner --out DIR # the learner phase only -> DIR/learner.json (gpu_check.sh)
    GPU_BENCH_SMOKE=1 bash tools/gpu/gpu_bench.sh   # same code path on CPU with a tiny model (numbers meaningless)

NOT RUN YET on a GPU: written on a CPU-only machine; the code path ran only in the CPU smoke mode
(and `launch/gpu_check.sh --dry-run`). Treat its first GPU run as its test.

Each phase runs in its own process and writes its own JSON as soon as it finishes, so a phase
that dies or times out loses only its own figures:
1. learner (torch + megatron-core only): a ~0.89B LLaMA (hidden 2048, 16 layers, 16 heads / 8 KV
   heads, FFN 5632, vocab 32000, untied) built from its config with megatron's random init (no
   checkpoint file, no tokenizer), TP=1, bf16 + DistributedOptimizer (`build_optimizer`),
   `train_step` on `--rows` x `--seq` tokens of NLL, 2 warm-up + `--steps` timed. Model FLOPs per
   token = 6 x parameters + 12 x layers x hidden x seq (attention scores and values, fwd + bwd,
   no recompute); MFU = FLOPs/s / 989.4e12 (H100/H200 SXM dense bf16). Memory by component
   (weights, fp32 grad buffer, fp32 master weights + Adam moments, activations = peak - static)
   in bytes and bytes per parameter, beside docs/scaling.md's estimates (2, 4, 12, and activations
   from its formula).
2. vllm (needs vLLM; skipped with the reason otherwise): a checkpoint of the same shape with the
   in-code tokenizer, one replica on the GPU AFTER the learner process has exited (vLLM insists on
   gpu_memory_utilization of the whole GPU being free), with PYTORCH_NVML_BASED_CUDA_CHECK=1 and
   VLLM_WORKER_MULTIPROC_METHOD=spawn (so no CUDA is initialised before a fork). Tokens/s of
   256 prompts x n=4 x 256 tokens (ignore_eos), bf16; weight sync (one vLLM weight update per
   version, 3 versions) only on CPU for now: GPU replicas take weights through vLLM's NCCL
   backend, which the sender does not drive yet (docs/replicas-and-weight-sync.md).
3. async (needs vLLM and >= 2 GPUs: learner on GPU 0, replica on GPU 1; on one GPU the placement
   rules refuse a shared GPU, so it is skipped with that reason): `megatron-async bench async`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tools/gpu/ -> the repository
sys.path.insert(0, str(REPO))

PEAK_BF16_FLOPS = 989.4e12  # H100/H200 SXM, dense bf16
SMOKE = os.environ.get("GPU_BENCH_SMOKE") == "1"
DOCS_BYTES_PER_PARAM = {"weights_bf16": 2, "grad_buffer_fp32": 4, "master_and_adam_fp32": 12}  # docs/scaling.md, DP=1


def spec():
    from megatron_async.models.tiny import TinyLlamaSpec

    if SMOKE:
        return TinyLlamaSpec(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, max_position_embeddings=1024)
    return TinyLlamaSpec(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, max_position_embeddings=2048)


def vocab() -> int:
    return 512 if SMOKE else 32000


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def learner(args) -> dict:
    """Phase 1 (this process): the learner alone. Returns (and writes) its figures."""
    import torch

    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.models.tiny import llama_config

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mem = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: None)  # noqa: E731
    s = spec()
    hf = llama_config(s, vocab(), 1, 2, 0).to_dict()
    init_parallel(1, 1, seed=0)
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = build_model(hf)  # bf16 on GPU, fp32 on CPU; megatron's random init
        params = sum(p.numel() for c in model.chunks for p in c.parameters())
        weights_b = _nbytes(p for c in model.chunks for p in c.parameters())
        policy, optimizer, scheduler = build_optimizer(model, OptimSettings(lr=1e-5))
        build_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        mask = torch.ones(args.micro_batch, args.seq)
        mask[:, : args.seq // 4] = 0  # a prompt part, as in RL batches
        mbs = [{"input_ids": torch.randint(3, vocab(), (args.micro_batch, args.seq), generator=g), "loss_mask": mask}
               for _ in range(max(1, args.rows // args.micro_batch))]

        def nll(logprobs, mb):
            m = mb["loss_mask"]
            return -(logprobs * m).sum() / m.sum(), {}

        warm = []
        for _ in range(2):
            warm.append(time.perf_counter())
            first = train_step(policy, optimizer, scheduler, mbs, nll)
            sync()
        warm.append(time.perf_counter())
        static = mem()  # after the first step: Adam state exists
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        metrics = [train_step(policy, optimizer, scheduler, mbs, nll) for _ in range(args.steps)]
        sync()
        step_s = (time.perf_counter() - t) / args.steps
        peak = torch.cuda.max_memory_allocated() if cuda else None
        grad_b = _nbytes(b.grad_data for c in policy.chunks for b in c.buffers)
        inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        adam_b = _nbytes(v for o in inner for st in o.state.values() for v in st.values()
                         if torch.is_tensor(v) and v.numel() > 1)
        master_b = _nbytes(p for o in inner for grp in o.param_groups for p in grp["params"]
                           if p.dtype == torch.float32 and cuda)  # fp32 master copies (bf16 model)
        tokens = len(mbs) * args.micro_batch * args.seq
        flops_per_token = 6 * params + 12 * s.num_hidden_layers * s.hidden_size * args.seq
        h, L, f, kv = s.hidden_size, s.num_hidden_layers, s.intermediate_size, s.num_key_value_heads
        d = h // s.num_attention_heads
        act_docs = L * (8 * args.seq * args.micro_batch * h + 2 * args.seq * args.micro_batch * (2 * h + 2 * kv * d + 3 * f))
        out = {
            "device": torch.cuda.get_device_name() if cuda else "cpu", "smoke_cpu": SMOKE, "parameters": params,
            "model": {"hidden": h, "layers": L, "heads": s.num_attention_heads, "kv_heads": kv, "ffn": f, "vocab": vocab()},
            "perf_settings": model.perf.to_dict(), "optimizer": type(inner[0]).__name__ if not hasattr(optimizer, "chained_optimizers")
            else type(optimizer.chained_optimizers[0]).__name__,
            "build_s": build_s, "warmup_step_s": [b - a for a, b in zip(warm, warm[1:])],
            "rows": len(mbs) * args.micro_batch, "micro_batch": args.micro_batch, "seq": args.seq,
            "tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "model_tflops_per_s": flops_per_token * tokens / step_s / 1e12,
            "mfu": flops_per_token * tokens / step_s / PEAK_BF16_FLOPS if cuda else None,
            "losses": [first["loss"]] + [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
            "skipped": sum(m["skipped"] for m in metrics),
            "memory_bytes": {"weights": weights_b, "grad_buffer": grad_b, "adam_moments": adam_b,
                             "master_weights": master_b, "static_allocated_after_step1": static,
                             "peak_allocated_in_steps": peak,
                             "activations_and_temporaries": (peak - static) if cuda else None},
            "memory_bytes_per_param": {"weights": weights_b / params, "grad_buffer": grad_b / params,
                                       "master_and_adam": (adam_b + master_b) / params},
            "docs_scaling_estimate": {"bytes_per_param": DOCS_BYTES_PER_PARAM,
                                      "activations_bytes_per_microbatch_no_recompute": act_docs,
                                      "formula": "L x (8 s b h + 2 s b (2h + 2 KV d + 3f)) (docs/scaling.md, "
                                                 "flash attention; the local spec materialises s x s scores too)"},
        }
        _write(Path(args.out) / "learner.json", out)
        return out
    finally:
        destroy_parallel()


def build_checkpoint(out: Path) -> Path:
    """An HF checkpoint of the benchmark's shape with the in-code BPE tokenizer (for vLLM)."""
    from megatron_async.data import load_problems
    from megatron_async.models.tiny import build_tiny_llama, build_tokenizer

    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        corpus = [f"{p.question}\n{p.solution}" for p in load_problems("synthetic", "train", 4000, 0)]
        tok = build_tokenizer(corpus, out / "tokenizer", vocab_size=1024)
        build_tiny_llama(model_dir, tok, spec(), seed=0)
    return model_dir


def vllm_phase(args) -> dict:
    """Phase 2 (its own process, after the learner's exited): generation tokens/s and weight sync."""
    import torch

    from megatron_async.rollout import ReplicaPool, ReplicaSpec, Sampling
    from megatron_async.weights.host_memory import HostMemorySender
    from megatron_async.weights.update import WeightUpdate

    cuda = torch.cuda.is_available()
    model_dir = build_checkpoint(Path(args.out))
    hf = json.loads((model_dir / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    rspec = ReplicaSpec(model=str(model_dir), dtype="bfloat16" if cuda else "float32", max_model_len=1024,
                        kv_cache_bytes=(16 << 30) if cuda else (256 << 20), seed=0)
    env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    out: dict = {}
    with ReplicaPool(rspec, 1, log_dir=Path(args.out) / "replica_logs", env=env, start_timeout_s=240) as pool:
        prompts = [torch.randint(3, hf["vocab_size"], (64,), generator=g).tolist() for _ in range(args.prompts)]
        pool.generate(prompts[:4], Sampling(max_tokens=8))  # warm-up
        sampling = Sampling(n=4, max_tokens=args.gen_tokens, ignore_eos=True, seed=0, logprobs=True)
        t = time.perf_counter()
        records = pool.generate(prompts, sampling)
        gen_s = time.perf_counter() - t
        n_tok = sum(len(r.token_ids) for r in records)
        out["generation"] = {"prompts": len(prompts), "n": 4, "max_tokens": args.gen_tokens, "tokens": n_tok,
                             "seconds": gen_s, "tokens_per_s": n_tok / gen_s, "enforce_eager": rspec.enforce_eager}
        _write(Path(args.out) / "vllm.json", out)
        if cuda:
            out["sync"] = {"skipped": "GPU replicas use vLLM's NCCL weight-transfer backend, not driven by the sender yet"}
            _write(Path(args.out) / "vllm.json", out)
            return out
        from safetensors.torch import load_file

        weights = load_file(str(model_dir / "model.safetensors"))
        syncs = []
        with HostMemorySender(pool.urls, pool.key, timeout_s=300, bucket_bytes=512 << 20) as sender:
            update = WeightUpdate.local(pool, sender, timeout_s=300)  # the learner's update, in this one process
            for version in range(1, 4):
                t = time.perf_counter()
                m = update.push(version, iter(weights.items()), check=False)
                seconds = time.perf_counter() - t
                syncs.append({"seconds": seconds, "gb_per_s": m.bytes_total / seconds / 1e9, "bytes": m.bytes,
                              "published": m.published, "failed": m.failed})
        out["sync"] = {"per_update": syncs, "seconds_mean": sum(s["seconds"] for s in syncs) / len(syncs)}
    _write(Path(args.out) / "vllm.json", out)
    return out


def _phase_cmd(phase: str, args) -> list[str]:
    return [sys.executable, __file__, phase, "--out", str(args.out),
            *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("rows", "seq", "micro_batch", "steps",
                                                                       "prompts", "gen_tokens")]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", nargs="?", default="all", choices=["all", "learner", "vllm"])
    p.add_argument("--out", default=str(REPO / "runs" / ("gpu_bench_smoke" if SMOKE else "gpu_bench")))
    p.add_argument("--rows", type=int, default=4 if SMOKE else 32)
    p.add_argument("--seq", type=int, default=128 if SMOKE else 1024)
    p.add_argument("--micro-batch", type=int, default=2 if SMOKE else 4)
    p.add_argument("--steps", type=int, default=2 if SMOKE else 5)
    p.add_argument("--prompts", type=int, default=4 if SMOKE else 256)
    p.add_argument("--gen-tokens", type=int, default=16 if SMOKE else 256)
    p.add_argument("--budget-s", type=float, default=470.0, help="whole script (the issue allows 8 minutes)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "learner":
        learner(args)
        return 0
    if args.phase == "vllm":
        vllm_phase(args)
        return 0

    import torch

    t0 = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    summary: dict = {"smoke_cpu": SMOKE}

    def run_phase(name: str, limit: float) -> None:
        try:
            subprocess.run(_phase_cmd(name, args), check=True, timeout=max(30.0, limit))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            summary[f"{name}_error"] = str(e)
        if (out / f"{name}.json").exists():  # what the phase wrote, even if it died later
            summary[name] = json.loads((out / f"{name}.json").read_text())

    run_phase("learner", min(200.0, left() - 150))
    have_vllm = importlib.util.find_spec("vllm") is not None
    if have_vllm:
        run_phase("vllm", min(200.0, left() - 60))
    else:
        summary["vllm_skipped"] = "vLLM is not installed"
    gpus = torch.cuda.device_count()
    if not have_vllm or (gpus < 2 and not SMOKE):
        summary["async_skipped"] = ("vLLM is not installed" if not have_vllm else
                                    f"{gpus} GPU: the placement rules refuse a learner and a replica on one GPU; "
                                    "needs 2 (learner GPU 0, replica GPU 1)")
    else:
        model_dir = build_checkpoint(out)
        bench = [sys.executable, "-m", "megatron_async", "bench", "async", str(REPO / "configs" / "cpu_tiny.yaml"),
                 f"model.hf_path={model_dir}", "sft.steps=0", "trainer.steps=5", "data.eval_size=8",
                 "trainer.micro_batch_size=8", "rollout.k=4",
                 *(["rollout.prompts_per_step=8", "rollout.max_new_tokens=16", "rollout.kv_cache_gib=0.25"] if SMOKE else
                   ["rollout.prompts_per_step=64", "rollout.max_new_tokens=256", "rollout.kv_cache_gib=16",
                    "model.dtype=bfloat16", "placement.learner_gpus=[0]", "placement.replica_gpus=[1]"]),
                 "--seeds", "1", "--pin", "none", "--out-dir", str(out / "async")]
        try:
            env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
            subprocess.run(bench, check=True, timeout=max(30.0, left() - 5), cwd=REPO, env=env)
            res = json.loads((out / "async" / "bench_async.json").read_text())
            summary["async"] = {k: res["summary"][k] for k in ("speedup", "ideal", "efficiency", "sync_mean_generation_s",
                                                              "sync_mean_train_s", "sync_mean_weight_sync_s")}
            summary["async"]["command"] = " ".join(bench)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError, KeyError) as e:
            summary["async_error"] = str(e)
    summary["seconds"] = time.monotonic() - t0
    _write(out / "summary.json", summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
