"""HF <-> Megatron checkpoint conversion (both directions go through `learner.mapping`).

    python -m megatron_async.learner.convert hf-to-megatron HF_DIR CKPT_DIR --tp 2 --pp 2
    python -m megatron_async.learner.convert megatron-to-hf CKPT_DIR HF_DIR [--tokenizer DIR] [--tp N --pp M]

The Megatron side is a `learner.checkpoint` directory (dist_checkpointing, model only), which
loads at any TP x PP; the HF side is safetensors + config.json + tokenizer files that transformers
and vLLM load. With tp * pp > 1 the command re-launches itself under torchrun (gloo on CPU). Both
outputs are written atomically (tmp dir, then rename).

The Megatron side holds the vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP
(zero rows, `learner.model.padded_vocab_size`); the HF side has exactly the config's vocab_size rows.
A checkpoint padded at one TP loads at another (megatron-core loads the overlapping rows).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_async.learner.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from megatron_async.learner.hf_export import export_hf, hf_side_files
from megatron_async.learner.mapping import load_hf_weights
from megatron_async.learner.model import VOCAB_DIVISIBLE_BY, build_model
from megatron_async.learner.parallel import destroy_parallel, free_port, init_parallel


def hf_to_megatron(src: Path, dst: Path, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> None:
    """(Under init_parallel.) Load the HF checkpoint into this layout and save it as a learner checkpoint."""
    model = build_model(src, make_vocab_size_divisible_by=vocab_divisible_by)
    load_hf_weights(model, src)
    files = {f"hf/{name}": path for name, path in hf_side_files(src).items()}
    save_checkpoint(dst, model, extra={"converted_from": str(src.resolve())}, files=files)


def megatron_to_hf(src: Path, dst: Path, tokenizer: Path | None, vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> None:
    """(Under init_parallel.) Load a learner checkpoint and write it as an HF checkpoint."""
    hf_config_path = src / "hf_config.json"
    if not hf_config_path.exists():
        raise FileNotFoundError(f"{hf_config_path} is missing: {src} was not saved from a model built from an HF config")
    hf_config = json.loads(hf_config_path.read_text())
    tok_dir = tokenizer or src / "hf"
    read_manifest(src, verify=False)  # a clear error early (on every rank) if src is no checkpoint
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"no tokenizer: {tok_dir} does not exist (pass --tokenizer DIR)")
    model = build_model(hf_config, make_vocab_size_divisible_by=vocab_divisible_by)
    load_checkpoint(src, model)
    export_hf(model, dst, tokenizer_dir=tok_dir, hf_config=hf_config)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-async convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors checkpoint -> learner (dist_checkpointing) checkpoint")
    b = sub.add_parser("megatron-to-hf", help="learner checkpoint -> HF safetensors checkpoint")
    b.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the one stored by hf-to-megatron)")
    for s in (a, b):
        s.add_argument("src", type=Path)
        s.add_argument("dst", type=Path)
        s.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert with")
        s.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert with")
        s.add_argument("--make-vocab-size-divisible-by", type=int, default=VOCAB_DIVISIBLE_BY, metavar="N",
                       help="pad the Megatron vocabulary to a multiple of N x tp (model.make_vocab_size_divisible_by)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    world = args.tp * args.pp
    if world > 1 and "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={free_port()}", "-m", "megatron_async.learner.convert", *argv]
        return subprocess.call(cmd)

    init_parallel(args.tp, args.pp)
    try:
        if args.command == "hf-to-megatron":
            hf_to_megatron(args.src, args.dst, args.make_vocab_size_divisible_by)
        else:
            megatron_to_hf(args.src, args.dst, args.tokenizer, args.make_vocab_size_divisible_by)
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    sys.exit(main(sys.argv[1:]))
