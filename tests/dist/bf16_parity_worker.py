"""The bf16 mixed-precision learner against the fp32 learner, step by step; prints JSON.

    python tests/dist/bf16_parity_worker.py RUN_DIR [FIRST_BATCH_SEED]

One rank (gloo), one thread. A tiny LLaMA of the main job's shape (`configs/cpu_tiny.yaml`, its
tokenizer trained on the fixed `models/tiny.default_corpus`) whose weights are rounded to bf16
before anything loads them, so both learners start from the same weights. For RLOO and Online DPO,
three learners are built from it and trained on the same fixed synthetic batches
(`bench.learner.synthetic_batch`, seeds FIRST_BATCH_SEED.. +STEPS-1, default 0), through `LearnerState.step` as the trainer
runs them:
- "fp32": `model.dtype=float32` (megatron's `FP32Optimizer`);
- "bf16": `model.dtype=bfloat16` (bf16 parameters, fp32 main weights: megatron's
  `Float16OptimizerWithFloat16Params`);
- "rounded": the fp32 learner with every module's output, the LM head's logits and every
  parameter's gradient rounded to bf16 (`x.bfloat16().float()` in forward hooks and around the
  head's projection, whose backward rounds the gradient there too; tensor hooks on the parameters): the control, what bf16 rounding of activations and gradients alone
  does to an otherwise fp32 learner, the same optimizer and weights.
After each step it records per learner the optimizer's view (loss scale, the reported gradient
norm, the clip coefficient it applied: the norm of the clipped main gradients over the reported
norm, and every parameter's lr, weight decay and Adam betas and eps) and, per pair, how the (main) weights compare.
test_bf16_parity.py reads the JSON and asserts.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_async.bench.learner import PROMPT_TOKENS, synthetic_batch
from megatron_async.config import load_config
from megatron_async.learner.mapping import load_hf_main_weights
from megatron_async.learner.model import unwrap_model
from megatron_async.learner.parallel import init_parallel
from megatron_async.models.base_model import load_tokenizer, tiny_spec
from megatron_async.models.tiny import build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.run.learner_state import LearnerState
from megatron_async.run_plan import build_plan

ALGORITHMS = ("rloo", "online_dpo")
STEPS = 4
# lr 1e-5 as the SmolLM2 recipe's (configs/cpu_smollm2_synthetic.yaml): most Adam steps are below
# one bf16 step of a weight. Linear decay over 8 steps, so the lr differs from step to step; weight
# decay on, so that it is compared too; clip_grad 1.0: Online DPO's gradients are clipped, RLOO's not.
SETTINGS = ["rollout.prompts_per_step=16", "rollout.k=4", "trainer.micro_batch_size=8", "trainer.steps=8",
            "trainer.lr=1e-5", "trainer.lr_decay=linear", "trainer.weight_decay=0.1", "trainer.grad_clip=1.0"]
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "rounded": "float32"}


def bf16_start(model_dir: Path) -> None:
    """Round the checkpoint's weights to bf16 (stored as fp32): the one start both precisions share."""
    for path in model_dir.glob("*.safetensors"):
        tensors = {name: t.bfloat16().float() for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})


def round_to_bf16(learner: LearnerState) -> None:
    """The control's rounding (module docstring), on the policy and the reference alike."""
    def round_output(module, inputs, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output.bfloat16().float()
        if isinstance(output, tuple):
            return tuple(o.bfloat16().float() if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in output)
        return output

    for chunk in [*learner.policy.model.chunks, *learner.reference.chunks]:
        gpt = unwrap_model(chunk)
        for module in gpt.modules():
            module.register_forward_hook(round_output)
        head = gpt.output_layer  # the loss calls its projection outside a module call (learner/lm_head.py)
        head.project = lambda hidden, weight=None, project=head.project: project(hidden, weight=weight).bfloat16().float()
        for p in chunk.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g.bfloat16().float())


def main_weights(learner: LearnerState, model: str = "policy") -> dict[str, torch.Tensor]:
    """name -> the fp32 weights the optimizer steps (bf16: its main copies), copied, of the policy
    or (`model="value"`) the value model."""
    trainable = getattr(learner, model)
    optimizer = trainable.optimizer
    main_of = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
            main_of.update({id(p): m for p, m in zip(model_group, main_group)})
    return {name: main_of.get(id(p), p).detach().float().clone()
            for name, p in unwrap_model(trainable.model.chunks[0]).named_parameters()}


def model_weights(learner: LearnerState) -> dict[str, torch.Tensor]:
    """name -> the parameters the forward reads (bf16: the bf16 copy), copied."""
    return {name: p.detach().clone() for name, p in unwrap_model(learner.policy.model.chunks[0]).named_parameters()}


def optimizer_view(learner: LearnerState) -> dict:
    """What the policy's optimizer did in its last step (module docstring)."""
    optimizer = learner.policy.optimizer
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    names = {id(p): n for n, p in unwrap_model(learner.policy.model.chunks[0]).named_parameters()}
    groups, clipped_sq = {}, 0.0
    for opt in optimizers:
        model_groups = getattr(opt, "float16_groups", None) or [g["params"] for g in opt.param_groups]
        for group, model_params in zip(opt.param_groups, model_groups):
            for main, p in zip(group["params"], model_params):
                groups[names[id(p)]] = {key: group[key] for key in ("lr", "weight_decay", "betas", "eps")}
                if main.grad is not None:
                    clipped_sq += main.grad.double().pow(2).sum().item()
    return {"loss_scale": float(optimizer.get_loss_scale()), "clipped_grad_norm": math.sqrt(clipped_sq),
            "main_dtypes": sorted({str(p.dtype) for opt in optimizers for g in opt.param_groups for p in g["params"]}),
            "param_groups": groups}


def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[n].double().flatten() for n in sorted(weights)])


def compare(a_now, a_before, b_now, b_before, start) -> dict:
    """Weights a against weights b (the fp32 learner's): relative error, to the weights and to how far
    b has moved from the start, and the cosine of this step's updates."""
    a, b, s = flat(a_now), flat(b_now), flat(start)
    da, db = a - flat(a_before), b - flat(b_before)
    return {"rel_err": ((a - b).norm() / b.norm()).item(),
            "rel_err_to_displacement": ((a - b).norm() / (b - s).norm()).item(),
            "update_cos": (torch.dot(da, db) / (da.norm() * db.norm())).item(),
            "update_norm_ratio": (da.norm() / db.norm()).item()}


def start_from_fp32_checkpoint(run_dir: Path, model_dir: Path, vocab: int, pad_id: int, layout, first_seed: int) -> dict:
    """A bf16 learner built from the checkpoint before its rounding (tiny's init is fp32, as SmolLM2's
    export): are its main weights the checkpoint's values, its bf16 copy their rounding, and what
    fraction of the copy its first RLOO step changes (the on-grid start's: `run`'s step 0). And a
    PPO learner's value model, from the same checkpoint: its trunk's main weights too. And how many
    main weights `load_hf_main_weights` sets from it, and from its copy stored in bf16 (none: the
    bf16 parameters hold its values already, and the checkpoint is not read again)."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml",
                      [f"run.out_dir={run_dir / 'fp32_checkpoint'}", "trainer.algorithm=rloo", "model.dtype=bfloat16",
                       *SETTINGS])
    learner = LearnerState.build(cfg, build_plan(cfg), model_dir, layout, pad_id)
    checkpoint = {name: t for path in model_dir.glob("*.safetensors") for name, t in load_file(path).items()}
    main, copy = main_weights(learner), model_weights(learner)
    # tiny's megatron names -> its HF tensors, for the parameters that are one HF tensor each
    pairs = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
             "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
             "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.0.self_attn.o_proj.weight"}
    exact = [n for n, hf in pairs.items() if not torch.equal(checkpoint[hf], checkpoint[hf].bfloat16().float())]
    ppo_cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml",
                          [f"run.out_dir={run_dir / 'fp32_checkpoint_ppo'}", "trainer.algorithm=ppo",
                           "model.dtype=bfloat16", *SETTINGS])
    value_main = main_weights(LearnerState.build(ppo_cfg, build_plan(ppo_cfg), model_dir, layout, pad_id), "value")
    bf16_stored = run_dir / "bf16_stored"
    shutil.copytree(model_dir, bf16_stored)
    for path in bf16_stored.glob("*.safetensors"):
        save_file({name: t.bfloat16() for name, t in load_file(path).items()}, path, metadata={"format": "pt"})
    main_weights_set = {where: load_hf_main_weights(learner.policy.model, learner.policy.optimizer, hf_dir)
                        for where, hf_dir in (("fp32_stored", model_dir), ("bf16_stored", bf16_stored))}
    learner.step(synthetic_batch(vocab, 16, 4, PROMPT_TOKENS["tiny"], 48, seed=first_seed), 0, updates=1)
    after = model_weights(learner)
    return {"not_bf16_exact": exact, "main_weights_set": main_weights_set,
            "main_is_checkpoint": all(torch.equal(main[n][:checkpoint[hf].shape[0]], checkpoint[hf]) for n, hf in pairs.items()),
            "value_trunk_main_is_checkpoint": all(torch.equal(value_main[n][:checkpoint[hf].shape[0]], checkpoint[hf])
                                                  for n, hf in pairs.items()),
            "value_head_main_is_zero": bool((value_main["output_layer.weight"] == 0).all()),
            "copy_is_rounded_checkpoint": all(torch.equal(copy[n][:checkpoint[hf].shape[0]], checkpoint[hf].bfloat16())
                                              for n, hf in pairs.items()),
            "copy_changed_fraction": sum((after[n] != copy[n]).sum().item() for n in copy) / sum(t.numel() for t in copy.values())}


def run(algorithm: str, run_dir: Path, model_dir: Path, vocab: int, pad_id: int, layout, first_seed: int) -> list[dict]:
    learners = {}
    for name, dtype in PRECISIONS.items():
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml",
                          [f"run.out_dir={run_dir / algorithm / name}", f"trainer.algorithm={algorithm}",
                           f"model.dtype={dtype}", *SETTINGS])
        learners[name] = LearnerState.build(cfg, build_plan(cfg), model_dir, layout, pad_id)
    round_to_bf16(learners["rounded"])
    start = main_weights(learners["fp32"])
    before = {name: main_weights(learner) for name, learner in learners.items()}
    copy_before = copy_start = model_weights(learners["bf16"])
    steps = []
    for step in range(STEPS):
        batch = synthetic_batch(vocab, 16, 4, PROMPT_TOKENS["tiny"], 48, seed=first_seed + step)
        record: dict = {"learners": {}}
        now = {}
        for name, learner in learners.items():
            metrics = learner.step(batch, step, updates=1)
            view = optimizer_view(learner)
            view.update(grad_norm=metrics["train/grad_norm"], lr=metrics["train/lr"], loss=metrics["train/loss"],
                        kl_ref=metrics["kl/ref"])
            record["learners"][name] = view
            now[name] = main_weights(learner)
        copy_now = model_weights(learners["bf16"])
        copy_of_main = {n: w.bfloat16() for n, w in now["bf16"].items()}
        changed = sum((copy_now[n] != copy_before[n]).sum().item() for n in copy_now)
        changed_since_start = sum((copy_now[n] != copy_start[n]).sum().item() for n in copy_now)
        total = sum(t.numel() for t in copy_now.values())
        record.update(
            bf16_vs_fp32=compare(now["bf16"], before["bf16"], now["fp32"], before["fp32"], start),
            rounded_vs_fp32=compare(now["rounded"], before["rounded"], now["fp32"], before["fp32"], start),
            copy_dtypes=sorted({str(t.dtype) for t in copy_now.values()}),
            copy_is_rounded_main=all(torch.equal(copy_now[n], copy_of_main[n]) for n in copy_now),
            copy_changed_fraction=changed / total, copy_changed_since_start_fraction=changed_since_start / total)
        steps.append(record)
        before, copy_before = now, copy_now
    return steps


if __name__ == "__main__":
    run_dir, first_seed = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    torch.set_num_threads(1)
    base = load_config(Path(__file__).resolve().parents[2] / "configs" / "cpu_tiny.yaml", [f"run.out_dir={run_dir}"])
    layout = init_parallel(1, 1, seed=base.run.seed)
    model_dir = run_dir / "base_model"
    build_tiny_llama(model_dir, build_tokenizer(default_corpus(), model_dir, vocab_size=1024), tiny_spec(base.model),
                     seed=base.run.seed)
    tokenizer = load_tokenizer(model_dir)
    from_fp32 = start_from_fp32_checkpoint(run_dir, model_dir, len(tokenizer), tokenizer.pad_token_id, layout, first_seed)
    bf16_start(model_dir)
    result = {"fp32_checkpoint": from_fp32} | {algorithm: run(algorithm, run_dir, model_dir, len(tokenizer), tokenizer.pad_token_id, layout, first_seed)
              for algorithm in ALGORITHMS}
    print("PARITY " + json.dumps(result))
