"""Worker for tests/test_learner_perf.py (world of one, CPU): GPU learner configurations built on CPU,
and the sequence padding that sequence parallelism needs.

    python tests/dist/perf_worker.py OUT.json HF_DIR
    torchrun --nproc-per-node 2 tests/dist/perf_worker.py OUT.json HF_DIR --overlap

- "gpu_local_spec": the TransformerConfig the learner uses on CUDA without Transformer Engine
  (the lent GPU machine's setup) builds a GPTModel with the local spec. The pre-fix flags
  (persist_layer_norm on CUDA) are built too and their error recorded: megatron's torch RMSNorm
  asserts persist_layer_norm is off, so the old GPU config could not build at all.
- "padding": logprobs, a training loss and values computed with every sequence padded to a
  multiple of 5 (as under sequence parallelism with TP=5) equal the unpadded ones.
- with --overlap, under torchrun at DP=2: training with parallel.overlap_grad_reduce forced on
  (the GPU default for DP > 1) gives the same steps as without.
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory


def gpu_local_spec(src: Path) -> dict:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_async.learner.model import read_arch, transformer_config
    from megatron_async.learner.perf import Backend, resolve

    arch = read_arch(src)
    perf = resolve(None, Backend(cuda=True, te=False), tp=1, dp=1)
    config = transformer_config(arch, dtype=torch.bfloat16, perf=perf)
    # the GPU config, except that parameters are created on the CPU (there is no GPU here)
    config = dataclasses.replace(config, use_cpu_initialization=True)

    def build(cfg):
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                        position_embedding_type="rope")

    out: dict[str, object] = {"perf": perf.to_dict(), "flags": {k: getattr(config, k) for k in (
        "sequence_parallel", "masked_softmax_fusion", "persist_layer_norm", "bias_activation_fusion",
        "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion", "bf16")}}
    model = build(config)
    out["params"] = sum(p.numel() for p in model.parameters())
    try:
        build(dataclasses.replace(config, persist_layer_norm=True))
        out["old_flags_error"] = ""
    except AssertionError as e:
        out["old_flags_error"] = str(e)
    return out


def padding(src: Path) -> dict:
    from megatron_async.learner import schedule
    from megatron_async.learner.value import build_value_model
    from tests.dist._learner import loaded_model

    model = loaded_model(src)
    values = build_value_model(src)
    head = values.chunks[0].output_layer
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
    mbs = batches(model.arch.vocab_size)  # [2, 12]: 12 is not a multiple of 5

    def run():
        return {"logprobs": schedule.compute_logprobs(model, mbs), "values": schedule.compute_values(values, mbs),
                "loss": schedule.forward_backward(model, mbs, nll, forward_only=True)["loss"]}

    plain = run()
    real = schedule.seq_multiple
    schedule.seq_multiple = lambda chunks: 5  # what sequence parallelism at TP=5 asks for: run at length 15
    try:
        padded = run()
    finally:
        schedule.seq_multiple = real
    diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))  # noqa: E731
    return {"shapes": [list(t.shape) for t in padded["logprobs"]], "logprob_diff": diff(plain["logprobs"], padded["logprobs"]),
            "value_diff": diff(plain["values"], padded["values"]), "value_scale": max(v.abs().max().item() for v in plain["values"]),
            "loss": plain["loss"], "loss_padded": padded["loss"]}


def overlap(src: Path) -> dict:
    """DP=2 (torchrun): three steps with parallel.overlap_grad_reduce forced on vs off, each rank on
    its own batch (so the DP reduce matters); the overlapped bucket reduce runs over gloo."""
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from megatron_async.learner.perf import PerfSettings
    from tests.dist._learner import tiny_learner

    out = {}
    for on in (False, True):
        ddp, opt, sched = tiny_learner(src, OptimSettings(lr=1e-3), perf=PerfSettings(overlap_grad_reduce=on))
        mbs = batches(ddp.arch.vocab_size, seed=torch.distributed.get_rank())
        steps = [train_step(ddp, opt, sched, mbs, nll) for _ in range(3)]
        out[f"overlap_{on}"] = {"ddp_overlap": ddp.chunks[0].ddp_config.overlap_grad_reduce,
                                "grad_norms": [m["grad_norm"] for m in steps], "losses": [m["loss"] for m in steps],
                                "weights": [p.detach().clone() for p in ddp.chunks[0].parameters()]}
    a, b = out["overlap_False"], out["overlap_True"]
    diff = max((x - y).abs().max().item() for x, y in zip(a.pop("weights"), b.pop("weights")))
    return {**out, "weight_diff": diff}


if __name__ == "__main__":
    out, src = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=0)
    try:
        if "--overlap" in sys.argv:
            result = overlap(src)
            if torch.distributed.get_rank() == 0:
                out.write_text(json.dumps(result, indent=1))
        else:
            out.write_text(json.dumps({"gpu_local_spec": gpu_local_spec(src), "padding": padding(src)}, indent=1))
    finally:
        destroy_parallel()
