"""Write a live (TP/PP-sharded) learner model as an HF checkpoint folder, atomically.

    export_hf(model, "runs/x/hf_final", tokenizer_dir="runs/x/base_model")   # all ranks

Each pipeline stage's source rank streams its tensors (`mapping.iter_hf_weights`) into size-capped
safetensors files; rank 0 merges the weight maps (one file -> model.safetensors, several -> an
index), copies tokenizer/generation files from `tokenizer_dir`, writes config.json (the HF config
the model was built from) and renames the folder into place. transformers and vLLM load it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from megatron_async.io_utils import replace_dir
from megatron_async.learner.mapping import iter_hf_weights
from megatron_async.learner.model import LearnerModel

# HF files that are neither weights nor config.json: tokenizer and generation settings.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
SHARD_BYTES = 2 << 30


def hf_side_files(hf_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(Path(hf_dir).iterdir())
            if p.is_file() and p.name != "config.json" and not p.name.endswith(WEIGHT_SUFFIXES)}


def _write_stage_shards(model: LearnerModel, out: Path, stage: int) -> dict[str, str]:
    """Stream this stage's HF tensors into size-capped safetensors files; returns name -> file."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size, k = 0, 0

    def flush():
        nonlocal shard, size, k
        fname = f"model-pp{stage:02d}-{k:04d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        shard, size, k = {}, 0, k + 1

    for name, tensor in iter_hf_weights(model):
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    return weight_map


def export_hf(model: LearnerModel, dst: str | os.PathLike, tokenizer_dir: str | os.PathLike,
              hf_config: dict | None = None) -> Path:
    """Collective over all learner ranks. `hf_config` defaults to the one the model was built from."""
    dst = Path(dst)
    hf_config = hf_config or model.hf_config
    if hf_config is None:
        raise ValueError("export_hf: the model carries no HF config (built from a LlamaArch?); pass hf_config")
    tmp = dst.with_name(dst.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    weight_map = _write_stage_shards(model, tmp, ps.get_pipeline_model_parallel_rank())
    maps: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(maps, weight_map)
    if dist.get_rank() == 0:
        merged = {k: v for m in maps for k, v in m.items()}
        files = sorted(set(merged.values()))
        if len(files) == 1:
            (tmp / files[0]).rename(tmp / "model.safetensors")
        else:
            total = sum((tmp / f).stat().st_size for f in files)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(merged.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        for name, path in hf_side_files(Path(tokenizer_dir)).items():
            shutil.copyfile(path, tmp / name)
        dtype = str(next(model.chunks[0].parameters()).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps({**hf_config, "dtype": dtype}, indent=2))
        replace_dir(tmp, dst)
    dist.barrier()
    return dst
