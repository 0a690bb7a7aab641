"""Worker for tests/test_learner_parity.py: megatron (TP=1) vs transformers logits and logprobs.

    python tests/dist/hf_parity_worker.py OUT.json MODEL_DIR... [--dtype bfloat16]

For each HF checkpoint: build the megatron GPTModel from its config.json in DTYPE (default fp32),
load its safetensors through learner.mapping, and record max |logits diff| against transformers in
fp32 on random tokens, and max |logprob diff| of the learner's own per-token logprobs
(`compute_logprobs`, the path training uses) against transformers' log_softmax. In bf16 the same
two for transformers run in bf16 too: bf16's own error, the yardstick of the test's tolerance.
For a model with rope scaling, also record how far transformers' own logits move when the scaling
is dropped (shows the comparison would see a wrong RoPE).
"""
import argparse
import json
from pathlib import Path

import torch


def megatron_logits(model, ids):
    """TP=1 logits over the HF vocabulary (the learner's padding columns cut off)."""
    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    from megatron_async.learner.lm_head import whole_logits

    hidden = model.chunks[0](ids, torch.arange(s).expand(b, s), mask)
    return whole_logits(model.chunks[0], hidden)[..., :model.arch.vocab_size]


def hf_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[b, s] log p(ids[:, t] | ids[:, :t]) from [b, s, vocab] logits, 0 at t = 0 (as the learner's)."""
    lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


def compare(src: Path, dtype: torch.dtype) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_async.learner.schedule import Tokens, compute_logprobs
    from tests.dist._learner import loaded_model

    model = loaded_model(src, dtype)
    vocab = model.arch.vocab_size
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
        got = megatron_logits(model, ids).float()
        logprobs = compute_logprobs(model, [Tokens(input_ids=ids, loss_mask=torch.ones(ids.shape))])[0]
    ref_logprobs = hf_logprobs(ref, ids)
    result = {"dtype": str(next(model.chunks[0].parameters()).dtype), "max_diff": (ref - got).abs().max().item(),
              "logprob_max_diff": (logprobs - ref_logprobs).abs().max().item(), "logit_scale": ref.abs().max().item()}
    if dtype != torch.float32:  # transformers' own error in this dtype, against its fp32
        with torch.no_grad():
            own = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()(ids).logits.float()
        result.update(hf_max_diff=(own - ref).abs().max().item(),
                      hf_logprob_max_diff=(hf_logprobs(own, ids) - ref_logprobs).abs().max().item())
    cfg = AutoConfig.from_pretrained(str(src))
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        plain = AutoModelForCausalLM.from_pretrained(str(src), config=cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            result["unscaled_diff"] = (plain(ids).logits - ref).abs().max().item()
    del model
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("models", type=Path, nargs="+")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    torch.set_num_threads(2)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    try:
        results = {m.name: compare(m, getattr(torch, a.dtype)) for m in a.models}
    finally:
        destroy_parallel()
    a.out.write_text(json.dumps(results, indent=2))
