"""Worker for tests/test_optimizer_guard.py: the NaN/inf gradient guard of `learner.optimizer.train_step`.

    torchrun --nproc-per-node 2 tests/dist/optimizer_guard_worker.py OUT_DIR HF_DIR --tp 2   # CPU, gloo
    torchrun --nproc-per-node 2 tests/dist/optimizer_guard_worker.py OUT_DIR HF_DIR --tp 2 --dtype bfloat16
    python tests/dist/optimizer_guard_worker.py OUT_DIR HF_DIR          # also on CUDA (test_gpu_learner.py)

The real megatron learner (gloo, CPU), five steps on one batch, each loss finite:
1. a normal step: its grad_norm must be the real one (recomputed here from the main grads);
2. an inf gradient on ONE tensor-parallel rank only (a hook on rank 0's shard of a linear_fc2
   weight): every rank must skip, also rank 1 whose own gradients are finite;
3. a NaN gradient everywhere (a custom autograd function on the logprobs: identity forward,
   NaN backward);
4. a NaN loss (the old guard's case);
5. a normal step again, which must move the weights.
After steps 2-4 the weights, the Adam state and the LR schedule must be bit-identical to after
step 1 (with bf16 params, the fp32 main weights too). `--dtype bfloat16` runs it on megatron's
mixed-precision optimizer (fp32 main weights and Adam state), as a GPU does; the default is the
backend's (fp32 on CPU, bf16 on CUDA). Each rank writes OUT_DIR/rank<r>.json.
"""
import argparse
import json
import math
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory


class NanGrad(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


def nan_grad_nll(logprobs, mb):
    return nll(NanGrad.apply(logprobs), mb)


def nan_loss_nll(logprobs, mb):
    loss, m = nll(logprobs, mb)
    return loss * math.nan, m


def optimizer_state(opt) -> dict:
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    out = {}
    for i, o in enumerate(inner):
        for j, (p, st) in enumerate(o.state.items()):
            for k, v in st.items():
                out[f"{i}.{j}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(float(v))
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def local_grads_finite(ddp) -> bool:
    return all(bool(torch.isfinite(b.grad_data).all()) for c in ddp for b in c.buffers)


def main_grad_norm(ddp) -> float:
    """The global gradient norm from the DDP main grads, counting TP-duplicated params once."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros(1, dtype=torch.float64, device=next(ddp[0].parameters()).device)  # NCCL: on the GPU
    for c in ddp:
        for p in c.parameters():
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.main_grad.double().pow(2).sum()
    torch.distributed.all_reduce(sq, group=ps.get_model_parallel_group())
    return float(sq.sqrt())


def main_weights(opt) -> dict:
    """The fp32 main copies of bf16 params (what Adam steps: this rank's shards of them with the
    DistributedOptimizer); empty in fp32."""
    out = {}
    for i, o in enumerate(getattr(opt, "chained_optimizers", [opt])):
        groups = getattr(o, "fp32_from_float16_groups", None) or getattr(o, "shard_fp32_from_float16_groups", [])
        out.update({f"{i}.{j}": w.detach().clone() for j, w in enumerate(w for group in groups for w in group)})
    return out


def precision(ddp, opt) -> dict:
    """What the optimizer trains: its class, and the dtypes of the params, main weights and Adam state."""
    inner = getattr(opt, "chained_optimizers", [opt])
    return {"optimizer": [type(o).__name__ for o in inner],
            "param_dtypes": sorted({str(p.dtype) for c in ddp.chunks for p in c.parameters()}),
            "main_weight_dtypes": sorted({str(w.dtype) for w in main_weights(opt).values()}),
            "stepped_dtypes": sorted({str(p.dtype) for o in inner for g in o.optimizer.param_groups for p in g["params"]}),
            "adam_state_dtypes": sorted({str(v.dtype) for o in inner for st in o.optimizer.state.values()
                                         for k, v in st.items() if torch.is_tensor(v) and k != "step"})}


def run(src: Path, out: Path, dtype: torch.dtype | None) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_async.learner.model import unwrap_model
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from tests.dist._learner import tiny_learner

    # linear decay: the LR moves with every step taken, so a skipped step that advanced the
    # schedule would show; clip far above the norm, so main grads stay unclipped for the check
    ddp, opt, sched = tiny_learner(src, OptimSettings(lr=1e-3, decay_steps=10, decay_style="linear", clip_grad=1e6,
                                                      adam_eps=1e-6), dtype)
    mbs = batches(ddp.arch.vocab_size)
    # this rank's own shards (iter_hf_weights would yield the full tensors on TP rank 0 only)
    weights = lambda: {n: p.detach().clone() for c in ddp.chunks for n, p in c.named_parameters()}  # noqa: E731
    schedule = lambda: {"num_steps": sched.num_steps, "lr": opt.param_groups[0]["lr"]}  # noqa: E731
    r = {"rank": torch.distributed.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}

    r["normal"] = train_step(ddp, opt, sched, mbs, nll)
    r["main_grad_norm"] = main_grad_norm(ddp.chunks)
    r["precision"] = precision(ddp, opt)
    w0, o0, s0, m0 = weights(), optimizer_state(opt), schedule(), main_weights(opt)
    r["adam_state_entries"] = len(o0)

    target = unwrap_model(ddp.chunks[0]).decoder.layers[0].mlp.linear_fc2.weight
    hook = target.register_hook(lambda g: torch.full_like(g, math.inf)) if r["tp_rank"] == 0 else None
    r["inf_one_rank"] = train_step(ddp, opt, sched, mbs, nll)
    r["inf_one_rank_local_finite"] = local_grads_finite(ddp.chunks)
    if hook is not None:
        hook.remove()
    r["nan_grad"] = train_step(ddp, opt, sched, mbs, nan_grad_nll)
    r["nan_loss"] = train_step(ddp, opt, sched, mbs, nan_loss_nll)
    r["untouched"] = {"weights": same(weights(), w0), "adam_state": same(optimizer_state(opt), o0),
                      "main_weights": same(main_weights(opt), m0), "schedule": schedule() == s0}
    r["schedule_before"], r["schedule_after_skips"] = s0, schedule()

    r["normal_again"] = train_step(ddp, opt, sched, mbs, nll)
    r["moved_after"] = not same(weights(), w0)
    r["main_weights_moved_after"] = not same(main_weights(opt), m0)
    r["schedule_final"] = schedule()
    return r


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("hf", type=Path)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the params' (default: the backend's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(a.tp, 1)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        result = run(a.hf, a.out, getattr(torch, a.dtype) if a.dtype else None)
        # NaN is not JSON: write it as a string the test reads back
        text = json.dumps(result, indent=1, default=str).replace("NaN", '"nan"').replace("Infinity", '"inf"')
        (a.out / f"rank{result['rank']}.json").write_text(text)
    finally:
        destroy_parallel()
