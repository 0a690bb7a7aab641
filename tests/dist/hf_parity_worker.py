"""Worker for tests/test_learner_parity.py: megatron (TP=1, fp32) vs transformers logits.

    python tests/dist/hf_parity_worker.py OUT.json MODEL_DIR...

For each HF checkpoint: build the megatron GPTModel from its config.json, load its safetensors
through learner.mapping, and record max |logits diff| against transformers on random tokens.
For a model with rope scaling, also record how far transformers' own logits move when the scaling
is dropped (shows the comparison would see a wrong RoPE).
"""
import json
import sys
from pathlib import Path

import torch


def megatron_logits(model, ids):
    """TP=1 logits over the HF vocabulary (the learner's padding columns cut off)."""
    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    from megatron_async.learner.lm_head import whole_logits

    hidden = model.chunks[0](ids, torch.arange(s).expand(b, s), mask)
    return whole_logits(model.chunks[0], hidden)[..., :model.arch.vocab_size]


def compare(src: Path) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_async.learner.model import build_model
    from megatron_async.learner.mapping import load_hf_weights

    model = build_model(src)
    load_hf_weights(model, src)
    vocab = model.arch.vocab_size
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
        got = megatron_logits(model, ids)
    result = {"max_diff": (ref - got).abs().max().item(), "logit_scale": ref.abs().max().item()}
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
    torch.set_num_threads(2)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1)
    try:
        results = {Path(m).name: compare(Path(m)) for m in sys.argv[2:]}
    finally:
        destroy_parallel()
    Path(sys.argv[1]).write_text(json.dumps(results, indent=2))
