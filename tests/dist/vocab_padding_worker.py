"""Worker for tests/test_vocab_padding.py: tiny models whose vocab_size TP does not divide, at TP=2.

    torchrun --nproc-per-node 2 tests/dist/vocab_padding_worker.py OUT MODEL_DIR...

For each HF checkpoint (vocab 301: padded to 512 at TP=2 with the default 128, so TP rank 1 holds
45 real rows of its 256), rank 0 writes OUT/<name>.pt and the ranks together write:
- the local embedding shape and whether the padding rows are zero; whether `iter_hf_weights`
  gives the checkpoint back bit-exactly (the HF shapes: padding stripped);
- OUT/<name>_roundtrip: HF -> Megatron checkpoint (`convert.hf_to_megatron`, padded 512) -> HF
  (`convert.megatron_to_hf` with make_vocab_size_divisible_by=1: padded 302, so the checkpoint
  loads through megatron-core's allow_shape_mismatch rows);
- the learner's logprobs (`compute_logprobs`, padding masked) and, from the same vocab-parallel
  logits, `token_logprobs` without the mask (what a log-softmax over the padded columns gives);
- one Adam step: its metrics, the largest |gradient| and |weight| in the padding rows after it,
  the HF-layout weights after it, and OUT/<name>_export (`export_hf` after the step).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory

if TYPE_CHECKING:  # megatron (schedule's import) is imported in the function that runs it
    from megatron_async.learner.schedule import Tokens


def microbatches(vocab: int) -> list[Tokens]:
    mbs = batches(vocab)
    mbs[0]["input_ids"][0, 5:9] = torch.tensor([vocab - 1, 260, 257, vocab - 2])  # targets in TP rank 1's slice
    return mbs


def padding_rows(chunk, record, grads: bool = False) -> list[torch.Tensor]:
    """This rank's padding rows of the embedding and the untied output layer (weights or grads) of
    `chunk`, one of `record`'s (a LearnerModel)."""
    from megatron.core import parallel_state as ps

    from megatron_async.learner.model import unwrap_model, vocab_shard_real_rows

    gpt = unwrap_model(chunk)
    real = vocab_shard_real_rows(record.arch.vocab_size, record.padded_vocab_size,
                                 ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    rows = []
    for weight in (gpt.embedding.word_embeddings.weight, gpt.output_layer.weight):
        if weight is None:  # tied: the output layer uses the embedding
            continue
        t = weight.main_grad if grads else weight.data
        rows.append(t[real:])
    return rows


def max_abs(tensors: list[torch.Tensor]) -> float:
    """Largest |x| over `tensors` on every TP rank."""
    m = torch.tensor(max((t.abs().max().item() for t in tensors if t.numel()), default=0.0))
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
    return m.item()


def run_model(src: Path, out: Path):
    from safetensors.torch import load_file

    from megatron_async.learner.convert import hf_to_megatron, megatron_to_hf
    from megatron_async.learner.hf_export import export_hf
    from megatron_async.learner.lm_head import lm_head
    from megatron_async.learner.logprobs import token_logprobs
    from megatron_async.learner.mapping import iter_hf_weights, load_hf_weights
    from megatron_async.learner.model import build_model
    from megatron_async.learner.schedule import _causal_mask, compute_logprobs
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step

    name, rank0 = src.name, torch.distributed.get_rank() == 0
    result: dict[str, Any] = {}
    model = build_model(src)
    gpt = model.chunks[0]
    result["padded_vocab_size"] = model.padded_vocab_size
    result["local_embedding_shape"] = list(gpt.embedding.word_embeddings.weight.shape)
    result["padding_zero_at_build"] = max_abs(padding_rows(gpt, model)) == 0.0
    load_hf_weights(model, src)
    result["padding_zero_after_load"] = max_abs(padding_rows(gpt, model)) == 0.0
    ref = load_file(str(src / "model.safetensors"))
    got = {k: v.clone() for k, v in iter_hf_weights(model)}
    if rank0:
        result["iter_hf_exact"] = got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

    # HF -> Megatron (padded 512) -> HF (loaded with another padding: 302 rows)
    ckpt = out / f"{name}_megatron"
    hf_to_megatron(src, ckpt)
    megatron_to_hf(ckpt, out / f"{name}_roundtrip", tokenizer=src, vocab_divisible_by=1)

    mbs = microbatches(model.arch.vocab_size)
    result["microbatches"] = mbs
    result["logprobs"] = compute_logprobs(model, mbs)
    ids = mbs[0]["input_ids"]
    b, s = ids.shape
    with torch.no_grad():
        hidden = gpt(ids, torch.arange(s).expand(b, s), _causal_mask(s, ids.device))  # [b, s, hidden]
        result["direct_masked"] = token_logprobs(hidden, ids, lm_head(gpt), vocab_size=model.arch.vocab_size)
        result["unmasked"] = token_logprobs(hidden, ids, lm_head(gpt))  # logits [b, s, 512 / TP], no mask

    ddp, opt, sched = build_optimizer(model, OptimSettings(lr=1e-3, adam_eps=1e-6, clip_grad=1.0, weight_decay=0.1))
    result["metrics"] = train_step(ddp, opt, sched, mbs, nll)
    result["padding_grad_max"] = max_abs(padding_rows(ddp.chunks[0], model, grads=True))
    result["padding_weight_max_after_step"] = max_abs(padding_rows(gpt, model))
    weights = {k: v.clone() for k, v in iter_hf_weights(ddp)}
    if rank0:
        result["weights_after_step"] = weights
    export_hf(model, out / f"{name}_export", tokenizer_dir=src)
    if rank0:
        torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(2, 1)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        for m in a.models:
            run_model(m, a.out)
    finally:
        destroy_parallel()
