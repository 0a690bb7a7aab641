"""Worker for tests/test_gpu_learner.py (CUDA, NCCL): TE-spec parity and bf16 training steps.

    python tests/dist/gpu_worker.py parity OUT.json HF_DIR
    torchrun --nproc-per-node N tests/dist/gpu_worker.py train OUT.json HF_DIR --tp N
"""
import argparse
import json
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory


def logits_of(chunks, ids):
    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1).view(1, 1, s, s)
    return chunks[0](ids, torch.arange(s, device=ids.device).expand(b, s), mask).float()


def parity(src: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_async.learner.model import build_model
    from megatron_async.learner.mapping import iter_hf_weights, load_hf_weights

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).cuda().eval()
    out = {}
    with torch.no_grad():
        ref = hf(ids).logits
        for dtype in (torch.float32, torch.bfloat16):
            chunks = build_model(src, dtype=dtype)
            load_hf_weights(chunks, src)
            key = str(dtype).removeprefix("torch.")
            out[f"{key}_max_diff"] = (logits_of(chunks, ids) - ref).abs().max().item()
            out[f"{key}_qkv_module"] = type(chunks[0].decoder.layers[0].self_attention.linear_qkv).__name__
            out[f"{key}_names"] = sorted(n for n, _ in iter_hf_weights(chunks))
    out["logit_scale"] = ref.abs().max().item()
    return out


def train(src: Path) -> dict:
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from megatron_async.learner.mapping import load_hf_weights

    chunks = build_model(src)  # bf16 on GPU
    load_hf_weights(chunks, src)
    ddp, opt, sched = build_optimizer(chunks, OptimSettings(lr=1e-3))
    mbs = batches(320)
    steps = [train_step(ddp, opt, sched, mbs, nll) for _ in range(4)]
    return {"dtype": str(next(chunks[0].parameters()).dtype), "optimizer": type(opt.chained_optimizers[0]).__name__
            if hasattr(opt, "chained_optimizers") else type(opt).__name__, "losses": [m["loss"] for m in steps],
            "grad_norms": [m["grad_norm"] for m in steps]}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["parity", "train"])
    p.add_argument("out", type=Path)
    p.add_argument("hf", type=Path)
    p.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    layout = init_parallel(a.tp, 1)
    try:
        result = parity(a.hf) if a.mode == "parity" else train(a.hf)
        if layout.rank == 0:
            a.out.write_text(json.dumps({"backend": torch.distributed.get_backend(), **result}, indent=2))
    finally:
        destroy_parallel()
