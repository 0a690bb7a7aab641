"""Worker for tests/test_learner_parity.py: run one TP x PP layout on tiny checkpoints, save results.

    python -m torch.distributed.run --nproc-per-node 4 tests/dist/learner_worker.py OUT --tp 2 --pp 2 MODEL_DIR...

For each model: load the HF checkpoint, check `iter_hf_weights` gives it back bit-exactly, then
save (from the ranks that hold them) full logits, logprobs, one train step's loss metrics, the
HF-layout gradients and the HF-layout weights after the Adam step, as OUT/<model>_*.pt.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # megatron (schedule's import) is imported in the functions that run it
    from megatron_async.learner.schedule import Tokens


def batches(vocab: int, seed: int = 0) -> list[Tokens]:
    g = torch.Generator().manual_seed(seed)
    mbs: list[Tokens] = []
    for _ in range(2):
        ids = torch.randint(3, vocab, (2, 12), generator=g)
        mask = torch.ones(2, 12)
        mask[:, :4] = 0  # prompt
        mask[1, 9:] = 0  # padding
        mbs.append({"input_ids": ids, "loss_mask": mask})
    return mbs


def nll(logprobs, mb):
    mask = mb["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {"tokens": mask.sum()}


def full_logits(model, ids):
    """Full-vocabulary logits through the pipeline schedule, gathered over TP (last stage only),
    the learner's vocabulary padding cut off (its padded size depends on TP)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_async.learner.lm_head import whole_logits
    from megatron_async.learner.model import unwrap_model

    vocab = model.arch.vocab_size

    def step(_, chunk):
        b, s = ids.shape
        out = chunk(ids, torch.arange(s).expand(b, s), torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s))
        logits = partial(whole_logits, unwrap_model(chunk))  # the hidden states -> [b, s, vocab / TP]
        return out, lambda x: (x.new_zeros(()), {"logits": gather_from_tensor_model_parallel_region(logits(x))[..., :vocab]})

    with torch.no_grad():
        store = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=model.chunks,
                                            num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                            forward_only=True)
    return store[0]["logits"] if store else None


def run_model(src: Path, out: Path, tp: int):
    from safetensors.torch import load_file
    from megatron.core import parallel_state as ps
    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from megatron_async.learner.mapping import iter_hf_weights
    from tests.dist._learner import loaded_model

    name = src.name
    model = loaded_model(src)
    ref = load_file(str(src / "model.safetensors"))
    for hf_name, t in iter_hf_weights(model):
        assert torch.equal(t, ref[hf_name]), f"round trip differs for {hf_name}"

    mbs = batches(model.arch.vocab_size)
    source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    last = ps.is_pipeline_last_stage()
    logits = full_logits(model, mbs[0]["input_ids"])
    logprobs = compute_logprobs(model, mbs)
    if last and source:
        torch.save({"logits": logits, "logprobs": logprobs}, out / f"{name}_fwd.pt")
    if torch.distributed.get_rank() == 0:  # logprobs reach every rank
        torch.save(logprobs, out / f"{name}_logprobs_rank0.pt")

    ddp, opt, sched = build_optimizer(model, OptimSettings(lr=1e-3, adam_eps=1e-6, clip_grad=0.5))
    metrics = train_step(ddp, opt, sched, mbs, nll)
    grads = {k: v.clone() for k, v in iter_hf_weights(ddp, grads=True)}
    weights = {k: v.clone() for k, v in iter_hf_weights(ddp)}
    stage = ps.get_pipeline_model_parallel_rank()
    if source:
        torch.save({"grads": grads, "weights": weights}, out / f"{name}_step_stage{stage}.pt")
    if torch.distributed.get_rank() == 0:
        torch.save(metrics, out / f"{name}_metrics_rank0.pt")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(a.tp, a.pp)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        for m in a.models:
            run_model(m, a.out, a.tp)
    finally:
        destroy_parallel()
