"""fp32 against bf16 megatron-core learner on CPU: the tiny model (or HF_PATH), one fixed batch, the same seed,
STEPS steps (default 5) of the SFT loss; prints the losses, grad norms and seconds per step as JSON.

    taskset -c 0 python tools/bf16_cpu_learner.py            # bf16 fails in megatron's optimizer
    PATCH=1 STEPS=12 taskset -c 0 python tools/bf16_cpu_learner.py
    PATCH=1 HF_PATH=runs/smollm2 taskset -c 0 python tools/bf16_cpu_learner.py   # an exported checkpoint

The learner is fp32 on CPU (learner/model.py). This measures why: megatron-core 0.16.1's
Float16OptimizerWithFloat16Params accepts only torch.cuda.* parameter types, and with PATCH=1 (its
constructor sees CUDA type names for CPU tensors) bf16 trains like fp32 but, without AMX, slower
(docs/real-models.md, "bf16 on CPU").
"""
import json
import os
import time
import traceback
from pathlib import Path

import torch

from megatron_async.config import load_config
from megatron_async.learner.mapping import load_hf_weights
from megatron_async.learner.model import build_model
from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
from megatron_async.learner.parallel import init_parallel
from megatron_async.models.base_model import prepare_base_model

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the one-process group init_parallel makes
os.environ.setdefault("MASTER_PORT", "29731")
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("STEPS", "5"))
HF_PATH = os.environ.get("HF_PATH", "tiny")  # model.hf_path: the built-in tiny model or a checkpoint

def _cuda_type_names(init):
    """Experimental shim (PATCH=1): during the optimizer's constructor, CPU tensors report the
    torch.cuda.* type names megatron's param.type() check expects (as cpu_shims._keep_on_cpu does
    for Tensor.cuda). Only the no-argument form of Tensor.type() is changed."""
    def wrapper(*args, **kwargs):
        saved = torch.Tensor.type
        def fake(self, *a, **k):
            name = saved(self, *a, **k)
            if a or k or self.is_cuda or not isinstance(name, str):
                return name
            return name.replace("torch.", "torch.cuda.", 1)
        torch.Tensor.type = fake
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = saved
    return wrapper

if os.environ.get("PATCH") == "1":
    from megatron.core.optimizer import optimizer as _mopt
    _mopt.Float16OptimizerWithFloat16Params.__init__ = _cuda_type_names(_mopt.Float16OptimizerWithFloat16Params.__init__)
    print("PATCH: Float16OptimizerWithFloat16Params.__init__ sees torch.cuda.* type names", flush=True)
cfg = load_config(REPO / "configs" / "cpu_tiny.yaml",
                  ["run.out_dir=/tmp/bf16_cpu_learner", "run.name=bf16_cpu_learner", f"model.hf_path={HF_PATH}"])
layout = init_parallel(1, 1, seed=1234)
src = prepare_base_model(cfg)

def batch(vocab, seed=0):  # one fixed microbatch, 8 x 64, first 16 tokens "prompt"
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (8, 64), generator=g)
    mask = torch.ones(8, 64); mask[:, :16] = 0
    return [{"input_ids": ids, "loss_mask": mask}]

def nll(logprobs, mb):  # SFT loss as tests/dist/learner_worker.py
    mask = mb["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {"tokens": mask.sum()}

def opt_name(opt):
    return ",".join(type(o).__name__ for o in opt.chained_optimizers) if hasattr(opt, "chained_optimizers") else type(opt).__name__

results = {}
for dtype in (torch.float32, torch.bfloat16):
    key = str(dtype).removeprefix("torch.")
    r = results[key] = {}
    try:
        torch.manual_seed(0)
        model = build_model(src, dtype=dtype)
        load_hf_weights(model, src)
        r["param_dtype"] = str(next(model.chunks[0].parameters()).dtype)
        r["config_bf16"] = model.chunks[0].config.bf16
        ddp, opt, sched = build_optimizer(model, OptimSettings(lr=1e-3))
        r["optimizer"] = opt_name(opt)
        inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
        r["inner_torch_optimizer"] = type(getattr(inner, "optimizer", None)).__name__
        masters = [p for g in inner.optimizer.param_groups for p in g["params"]]
        r["master_param_dtypes"] = sorted({str(p.dtype) for p in masters})
        mbs = batch(model.arch.vocab_size)
        w0 = next(ddp.chunks[0].parameters()).detach().float().clone()
        losses, norms, secs, skipped = [], [], [], []
        for i in range(STEPS):
            t = time.perf_counter()
            m = train_step(ddp, opt, sched, mbs, nll)
            secs.append(time.perf_counter() - t)
            losses.append(m["loss"]); norms.append(m["grad_norm"]); skipped.append(m["skipped"])
            print(key, i, m, f"{secs[-1]:.3f}s", flush=True)
        r.update(losses=losses, grad_norms=norms, skipped=skipped, seconds=secs,
                 median_s_after_warmup=sorted(secs[1:])[len(secs[1:]) // 2],
                 loss_decreases=all(b < a for a, b in zip(losses, losses[1:])),
                 first_param_changed=(next(ddp.chunks[0].parameters()).detach().float() - w0).abs().max().item())
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()
        traceback.print_exc()
print("RESULT " + json.dumps(results, indent=1))
