"""Worker for tests/test_gpu_learner.py (CUDA, NCCL): parity, bf16 training, checkpoints, HF export.

    python tests/dist/gpu_worker.py parity OUT.json HF_DIR
    torchrun --nproc-per-node N tests/dist/gpu_worker.py train OUT.json HF_DIR --tp N
    python tests/dist/gpu_worker.py checkpoint OUT.json HF_DIR
    python tests/dist/gpu_worker.py export OUT.json HF_DIR
    python tests/dist/gpu_worker.py main_weights OUT.json HF_DIR

Every mode also runs on CPU (gloo; fp32 but for main_weights: tests/test_gpu_check.py runs checkpoint,
export and main_weights there, so this file cannot rot between GPU runs); the GPU tests assert the
CUDA specifics.

TF32: parity runs with torch's fp32 matmuls in IEEE fp32 (TF32 off, set here, recorded in the
output). Transformer Engine's own GEMMs do not follow that switch (its cuBLASLt call asks for
CUBLAS_COMPUTE_32F_FAST_TF32 for fp32 inputs), so with the TE spec the fp32 logits carry TF32
rounding; the test's tolerance says which case it is in.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory


def tf32_off() -> dict:
    """IEEE fp32 for torch's CUDA matmuls and cuDNN (the new API where torch has it, else the legacy one)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
        return {"matmul": torch.backends.cuda.matmul.fp32_precision, "cudnn": torch.backends.cudnn.fp32_precision}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"matmul": "ieee", "cudnn": "ieee"}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logits_of(model, ids):
    """TP=1 logits over the HF vocabulary (the learner's padding columns cut off)."""
    from megatron_async.learner.lm_head import whole_logits

    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1).view(1, 1, s, s)
    hidden = model.chunks[0](ids, torch.arange(s, device=ids.device).expand(b, s), mask)
    out = whole_logits(model.chunks[0], hidden).float()
    return out[..., :model.arch.vocab_size]


def parity(src: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_async.learner.mapping import iter_hf_weights
    from tests.dist._learner import loaded_model

    out: dict[str, object] = {"tf32": tf32_off()}
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    hf = hf.to(DEVICE).eval()  # type: ignore[arg-type]  # transformers types its decorated .to() without self
    with torch.no_grad():
        ref = hf(ids).logits
        for dtype in (torch.float32, torch.bfloat16):
            model = loaded_model(src, dtype)
            key = str(dtype).removeprefix("torch.")
            out[f"{key}_max_diff"] = (logits_of(model, ids) - ref).abs().max().item()
            out[f"{key}_qkv_module"] = type(model.chunks[0].decoder.layers[0].self_attention.linear_qkv).__name__
            out[f"{key}_names"] = sorted(n for n, _ in iter_hf_weights(model))
            out[f"{key}_perf"] = model.perf.to_dict()
    out["logit_scale"] = ref.abs().max().item()
    return out


def _optimizer_name(opt) -> str:
    return type(opt.chained_optimizers[0]).__name__ if hasattr(opt, "chained_optimizers") else type(opt).__name__


def train(src: Path) -> dict:
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from tests.dist._learner import loaded_model

    model = loaded_model(src)  # bf16 on GPU
    ddp, opt, sched = build_optimizer(model, OptimSettings(lr=1e-3))
    mbs = batches(320)
    steps = [train_step(ddp, opt, sched, mbs, nll) for _ in range(4)]
    return {"dtype": str(next(model.chunks[0].parameters()).dtype), "optimizer": _optimizer_name(opt),
            "losses": [m["loss"] for m in steps], "grad_norms": [m["grad_norm"] for m in steps],
            "skipped": [m["skipped"] for m in steps], "perf": model.perf.to_dict()}


def checkpoint(src: Path, work: Path) -> dict:
    """bf16 + DistributedOptimizer on CUDA: one step, save, a second step; then a fresh learner loads
    the checkpoint and takes the same second step. Both second steps must agree."""
    from megatron_async.learner.checkpoint import load_checkpoint, save_checkpoint
    from megatron_async.learner.mapping import iter_hf_weights
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from tests.dist._learner import tiny_learner

    settings = OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, decay_style="cosine")

    def fresh():
        return tiny_learner(src, settings)

    ckpt = work / "ckpt"
    ddp, opt, sched = fresh()
    train_step(ddp, opt, sched, batches(320, seed=0), nll)
    save_checkpoint(ckpt, ddp, opt, sched, extra={"step": 1})
    a = train_step(ddp, opt, sched, batches(320, seed=1), nll)
    wa = {k: v.float().cpu().clone() for k, v in iter_hf_weights(ddp)}
    del ddp, opt, sched
    ddp, opt, sched = fresh()
    extra = load_checkpoint(ckpt, ddp, opt, sched)
    b = train_step(ddp, opt, sched, batches(320, seed=1), nll)
    wb = {k: v.float().cpu().clone() for k, v in iter_hf_weights(ddp)}
    return {"optimizer": _optimizer_name(opt), "extra": extra, "loss_saved_run": a["loss"], "loss_resumed": b["loss"],
            "lr_saved_run": a["lr"], "lr_resumed": b["lr"], "weight_max_diff": max((wa[k] - wb[k]).abs().max().item() for k in wa),
            "same_names": sorted(wa) == sorted(wb)}


def main_weights(src: Path) -> dict:
    """A bf16 learner from a checkpoint with more precision (tiny's fp32 init): after
    `load_hf_main_weights` every fp32 main weight (on CUDA the DistributedOptimizer's shard of it) is
    the checkpoint's value, which the fp32 learner holds in megatron's layout."""
    from megatron_async.learner.mapping import load_hf_main_weights
    from megatron_async.learner.model import unwrap_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer
    from tests.dist._learner import loaded_model

    exact = {n: p.detach().reshape(-1) for n, p in unwrap_model(loaded_model(src, torch.float32).chunks[0]).named_parameters()}
    ddp, opt, _ = build_optimizer(loaded_model(src, torch.bfloat16), OptimSettings(lr=1e-3))
    ranges = {}  # the DistributedOptimizer's shard of each parameter on this rank
    for o in getattr(opt, "chained_optimizers", [opt]):
        if hasattr(o, "_get_model_param_range_map"):
            ranges.update({p: o._get_model_param_range_map(p)["param"] for g in o.model_float16_groups for p in g})
    count = load_hf_main_weights(ddp, opt, src)
    equal, mains = [], 0
    for name, param in unwrap_model(ddp.chunks[0]).named_parameters():
        main = getattr(param, "main_param", None)
        if main is None:
            continue
        mains += 1
        want = exact[name][ranges[param].start:ranges[param].end] if param in ranges else exact[name]
        equal.append(torch.equal(main.reshape(-1), want))
    return {"optimizer": _optimizer_name(opt), "sharded": bool(ranges), "set": count, "main_params": mains,
            "main_equal_checkpoint": bool(equal) and all(equal),
            "not_bf16_exact": sum(not torch.equal(t, t.bfloat16().float()) for t in exact.values())}


def export(src: Path, work: Path) -> dict:
    """A learner (bf16 on CUDA) written as an HF folder (`export_hf`), reloaded by transformers: the
    tensors are the loaded checkpoint's in the learner's dtype, and transformers' logits match ours."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_async.learner.hf_export import export_hf
    from tests.dist._learner import loaded_model

    model = loaded_model(src)
    dst = export_hf(model, work / "hf_export", tokenizer_dir=src)
    exported, source = load_file(str(dst / "model.safetensors")), load_file(str(src / "model.safetensors"))
    dtype = next(model.chunks[0].parameters()).dtype
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(str(dst), dtype=dtype)
    hf = hf.to(DEVICE).eval()  # type: ignore[arg-type]  # transformers types its decorated .to() without self
    with torch.no_grad():
        ours, theirs = logits_of(model, ids), hf(ids).logits.float()
    return {"config_dtype": json.loads((dst / "config.json").read_text()).get("dtype"),
            "names_match": sorted(exported) == sorted(source),
            "model_dtype": str(dtype), "exported_dtypes": sorted({str(t.dtype) for t in exported.values()}),
            "weights_equal_source_in_model_dtype": all(torch.equal(exported[k], source[k].to(dtype)) for k in source),
            "logit_max_diff": (ours - theirs).abs().max().item(), "logit_scale": theirs.abs().max().item(),
            "tokenizer_copied": (dst / "tokenizer.json").exists() or (dst / "tokenizer_config.json").exists()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["parity", "train", "checkpoint", "export", "main_weights"])
    p.add_argument("out", type=Path)
    p.add_argument("hf", type=Path)
    p.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    layout = init_parallel(a.tp, 1)
    work = a.out.with_suffix(".work")
    try:
        if a.mode in ("checkpoint", "export"):
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
        result = {"parity": lambda: parity(a.hf), "train": lambda: train(a.hf),
                  "checkpoint": lambda: checkpoint(a.hf, work), "export": lambda: export(a.hf, work),
                  "main_weights": lambda: main_weights(a.hf)}[a.mode]()
        if layout.rank == 0:
            a.out.write_text(json.dumps({"backend": torch.distributed.get_backend(), **result}, indent=2))
    finally:
        destroy_parallel()
