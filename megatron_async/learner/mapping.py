"""THE mapping between megatron-core GPTModel shards and HF LLaMA-family tensors.

Used by the HF -> Megatron load, the Megatron -> HF conversion and the weight sync to vLLM, so the
three can never disagree. Layouts (megatron-core 0.16, checked bit-exactly by the tests):

- `linear_qkv` rows are grouped per query group g: [q heads of g; k_g; v_g] (head_dim rows each).
  A TP shard is a contiguous run of whole groups, so gathering shards gives back the full fused
  tensor whatever the TP size.
- `linear_fc1` is [gate; up]; its TP shard r is cat(gate_chunk_r, up_chunk_r), so gathered shards
  read [gate_0; up_0; gate_1; up_1; ...].
- column-parallel (qkv, fc1), embedding and output layer split dim 0; row-parallel (`linear_proj`,
  `linear_fc2`) split dim 1; norms are replicated.
- PP: each layer knows its global index (`layer.layer_number`, 1-based).
- Tied embeddings: `output_layer.weight` exists only on the last stage when PP > 1; it is loaded
  from `model.embed_tokens.weight` and never yielded (the first stage yields that).
- Vocabulary padding (`learner.model.padded_vocab_size`): the embedding and output layer have
  `LearnerModel.padded_vocab_size` rows, the HF tensors `arch.vocab_size`. HF -> megatron appends ZERO
  rows before splitting over TP (kind "vocab"); megatron -> HF cuts the gathered tensor back to
  vocab_size rows, so an HF export and the tensors synced to vLLM are exactly HF-shaped. Zeros,
  not megatron-LM's converters' copies of the last row or a small random init: the learner masks
  the padded logits to -inf (`learner.logprobs.mask_vocab_padding`) and never looks the rows up,
  so their values cannot matter; zeros are the same at every TP, get zero gradient (Adam and
  weight decay leave them zero), and would give logit 0, not a random one, to any tool that
  read a megatron checkpoint without the mask.
- `score_head=True` (loading a PPO value model, `learner.value`, from a reward model): the
  checkpoint is an HF `*ForSequenceClassification` with one label: the trunk as above, no
  `lm_head.weight`, and `score.weight` [1, hidden] for the value head's weight (replicated over
  TP); the value head's bias has no HF tensor and is left as it is.

Public API: `expected_hf_shapes`, `validate_hf_checkpoint`, `load_hf_weights`, `load_hf_main_weights`,
`iter_hf_weights`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_async.learner.model import LearnerModel, LlamaArch, read_arch, unwrap_model as _unwrap


@dataclass(frozen=True)
class Rule:
    """How one megatron parameter maps to HF tensors: `hf` suffixes, TP split dim, fused kind."""

    hf: tuple[str, ...]
    split_dim: int | None  # None: replicated across TP
    kind: str = "plain"  # plain | qkv | fc1 | vocab (padded rows, see the module docstring)


_QKV_W = Rule(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0, "qkv")
_QKV_B = Rule(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), 0, "qkv")
_IN_NORM = Rule(("input_layernorm.weight",), None)
_POST_NORM = Rule(("post_attention_layernorm.weight",), None)

# Per-layer megatron suffix -> rule. The `layer_norm_weight` names are Transformer Engine's, whose
# spec fuses the norms into the following linear layer.
LAYER_RULES = {
    "input_layernorm.weight": _IN_NORM,
    "self_attention.linear_qkv.layer_norm_weight": _IN_NORM,
    "self_attention.linear_qkv.weight": _QKV_W,
    "self_attention.linear_qkv.bias": _QKV_B,
    "self_attention.linear_proj.weight": Rule(("self_attn.o_proj.weight",), 1),
    "pre_mlp_layernorm.weight": _POST_NORM,
    "mlp.linear_fc1.layer_norm_weight": _POST_NORM,
    "mlp.linear_fc1.weight": Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, "fc1"),
    "mlp.linear_fc2.weight": Rule(("mlp.down_proj.weight",), 1),
}
EMBED = "model.embed_tokens.weight"
TOP_RULES = {
    "embedding.word_embeddings.weight": Rule((EMBED,), 0, "vocab"),
    "decoder.final_layernorm.weight": Rule(("model.norm.weight",), None),
    "output_layer.weight": Rule(("lm_head.weight",), 0, "vocab"),
}
_TIED_OUTPUT = Rule((EMBED,), 0, "vocab")
SCORE = "score.weight"
_SCORE_HEAD = Rule((SCORE,), None)
# Which output layer a model's HF tensors have (`_named_rules`): the LM head (or the tied embedding),
# a value head's `score.weight`, or none (a value model's zero head, from the policy's checkpoint).
Head = Literal["lm", "score", "none"]


# ---- the layout arithmetic (the only copy) -------------------------------------------------------

def _qkv_group_view(fused: torch.Tensor, arch: LlamaArch) -> torch.Tensor:
    q_per_group = arch.num_heads // arch.num_kv_heads
    # [groups * (q_per_group + 2) * head_dim, ...] -> [groups, q_per_group + 2, head_dim, ...]
    return fused.reshape(arch.num_kv_heads, q_per_group + 2, arch.head_dim, *fused.shape[1:])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LlamaArch) -> torch.Tensor:
    """HF q/k/v (weights [heads*hd, H] or biases [heads*hd]) -> megatron's full grouped linear_qkv."""
    g, hd, rest = arch.num_kv_heads, arch.head_dim, q.shape[1:]
    grouped = torch.cat(
        [q.reshape(g, -1, hd, *rest), k.reshape(g, 1, hd, *rest), v.reshape(g, 1, hd, *rest)], dim=1
    )  # [groups, q_per_group + 2, head_dim, ...]
    return grouped.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, arch: LlamaArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`, from the full (TP-gathered) fused tensor."""
    grouped = _qkv_group_view(fused, arch)
    rest = fused.shape[1:]
    q = grouped[:, :-2].reshape(-1, *rest)
    k = grouped[:, -2].reshape(-1, *rest)
    v = grouped[:, -1].reshape(-1, *rest)
    return q, k, v


def fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP shard `rank` of linear_fc1: cat(gate_chunk_rank, up_chunk_rank)."""
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def split_fc1(gathered: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fc1_shard` over all ranks: [g_0; u_0; g_1; u_1; ...] -> (gate, up)."""
    per_rank = gathered.reshape(tp, 2, -1, *gathered.shape[1:])  # [tp, gate|up, F/tp, H]
    return per_rank[:, 0].reshape(-1, *gathered.shape[1:]), per_rank[:, 1].reshape(-1, *gathered.shape[1:])


def pad_vocab(hf: torch.Tensor, padded: int) -> torch.Tensor:
    """An HF [vocab_size, ...] embedding / lm_head with zero rows appended up to `padded` rows."""
    if padded < hf.shape[0]:
        raise ValueError(f"padded vocabulary ({padded}) is smaller than the tensor's {hf.shape[0]} rows")
    if padded == hf.shape[0]:
        return hf
    return torch.cat([hf, hf.new_zeros(padded - hf.shape[0], *hf.shape[1:])])


def to_megatron_shard(hf: list[torch.Tensor], rule: Rule, arch: LlamaArch, tp: int, rank: int,
                      padded_vocab: int | None = None) -> torch.Tensor:
    """The TP shard `rank` of a megatron parameter, from its HF tensors (in `rule.hf` order).
    `padded_vocab`: the model's vocabulary rows (kind "vocab"; default arch.vocab_size, no padding)."""
    if rule.kind == "fc1":
        return fc1_shard(hf[0], hf[1], tp, rank)
    full = fuse_qkv(hf[0], hf[1], hf[2], arch) if rule.kind == "qkv" else hf[0]
    if rule.kind == "vocab":
        full = pad_vocab(full, padded_vocab or arch.vocab_size)
    return full if rule.split_dim is None else full.chunk(tp, dim=rule.split_dim)[rank]


def to_hf(gathered: torch.Tensor, rule: Rule, arch: LlamaArch, tp: int) -> tuple[torch.Tensor, ...]:
    """HF tensors (in `rule.hf` order) from a megatron parameter's TP shards concatenated on split_dim
    (kind "vocab": the padding rows cut off, a view)."""
    if rule.kind == "qkv":
        return split_qkv(gathered, arch)
    if rule.kind == "fc1":
        return split_fc1(gathered, tp)
    if rule.kind == "vocab":
        return (gathered[:arch.vocab_size],)
    return (gathered,)


# ---- names, shapes and validation ----------------------------------------------------------------

def expected_hf_shapes(arch: LlamaArch, score_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of `arch` must hold, with its shape (`score_head`: a
    one-label sequence classifier's, see the module docstring)."""
    H, F, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {EMBED: (V, H), "model.norm.weight": (H,)}
    if score_head:
        shapes[SCORE] = (1, H)
    elif not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H),
            p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
        })
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _safetensors_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: hf_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir} (only safetensors checkpoints are loaded)")
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names.update({k: f for k in fh.keys()})
    return names


def validate_hf_checkpoint(hf_dir: str | os.PathLike, arch: LlamaArch | None = None,
                           score_head: bool = False) -> dict[str, Path]:
    """Check an HF checkpoint's tensor names and shapes against its architecture, reading headers
    only. Returns name -> file. Raises ValueError listing every missing, unexpected or misshapen
    tensor (name, expected vs found)."""
    hf_dir = Path(hf_dir)
    arch = arch or read_arch(hf_dir)
    files = _safetensors_files(hf_dir)
    want = expected_hf_shapes(arch, score_head)
    problems = [f"missing tensor {k} (expected shape {list(s)})" for k, s in want.items() if k not in files]
    optional = {"lm_head.weight"} if arch.tie_word_embeddings and not score_head else set()
    for name, f in files.items():
        if name in optional or name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in want:
            problems.append(f"unexpected tensor {name} in {f.name}")
            continue
        with safe_open(str(f), framework="pt") as fh:
            shape = tuple(fh.get_slice(name).get_shape())
        if shape != want[name]:
            problems.append(f"tensor {name} in {f.name} has shape {list(shape)}, the config implies {list(want[name])}")
    if problems:
        raise ValueError(f"HF checkpoint {hf_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    return files


def _named_rules(chunk, arch: LlamaArch, head: Head = "lm") -> Iterator[tuple[str, torch.nn.Parameter, Rule, str]]:
    """(megatron name, param, rule, HF prefix) for every parameter of a model chunk whose HF tensor
    the checkpoint holds (`head`: `Head`)."""
    model = _unwrap(chunk)
    layer_params = set()
    for layer in model.decoder.layers:
        prefix = f"model.layers.{layer.layer_number - 1}."
        for name, param in layer.named_parameters():
            layer_params.add(id(param))
            if name not in LAYER_RULES:
                raise KeyError(f"no HF mapping for megatron parameter decoder.layers.*.{name}")
            yield f"layer{layer.layer_number - 1}.{name}", param, LAYER_RULES[name], prefix
    for name, param in model.named_parameters():
        if id(param) in layer_params:
            continue
        if head != "lm" and name.startswith("output_layer."):
            if head == "score" and name == "output_layer.weight":
                yield name, param, _SCORE_HEAD, ""
            continue  # output_layer.bias: the value head's own, no HF tensor
        if name not in TOP_RULES:
            raise KeyError(f"no HF mapping for megatron parameter {name}")
        rule = _TIED_OUTPUT if name == "output_layer.weight" and arch.tie_word_embeddings else TOP_RULES[name]
        yield name, param, rule, ""


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()


@torch.no_grad()
def load_hf_weights(model: LearnerModel, hf_dir: str | os.PathLike, score_head: bool = False) -> None:
    """Load an HF safetensors checkpoint into this rank's (TP/PP-sharded) model chunks.

    Validates names and shapes first (`validate_hf_checkpoint`), then streams: each parameter reads
    only its own HF tensors, builds this rank's shard and copies it in. `score_head`: a one-label
    sequence classifier into a value model (module docstring).
    """
    for param, shard in _hf_shards(model, hf_dir, "score" if score_head else "lm"):
        param.copy_(shard)


@torch.no_grad()
def load_hf_main_weights(model: LearnerModel, optimizer, hf_dir: str | os.PathLike, score_head: bool = False) -> int:
    """A mixed-precision learner's fp32 main weights from the checkpoint's own values; -> how many
    parameters it set (0 for an fp32 learner, whose parameters are their main weights).

    megatron makes the main weights from the bf16 parameters, so from a checkpoint with more
    precision (SmolLM2's export is fp32) they start rounded onto the bf16 grid. The bf16 copy the
    forward reads then changes only once an element has moved half a bf16 step the same way, which
    at a fine-tuning lr takes many steps (docs/real-models.md). From the checkpoint's values the
    rounding boundaries lie anywhere in a step's reach, and the bf16 copy follows the main weights
    in expectation from the first step. For a checkpoint stored in bf16 (LLaMA's) the two are the
    same, and it is not read again (a 70B checkpoint is 140 GB). Call after `build_optimizer`
    (`optimizer` is its ChainedOptimizer); with the DistributedOptimizer each rank sets its own
    shard of each main weight. `score_head`: as for `load_hf_weights`; a value model from the
    policy's checkpoint (`model.value_head`) has a zero head that checkpoint does not hold, whose
    main weights are exact already: only its trunk's are set.
    """
    if not any(getattr(p, "main_param", None) is not None for chunk in model.chunks for p in chunk.parameters()):
        return 0  # fp32: no second read of the checkpoint
    if _stored_in_bf16(hf_dir):
        return 0
    ranges = {}  # param -> its shard's range in the flattened parameter (the DistributedOptimizer)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_get_model_param_range_map"):
            for group in opt.model_float16_groups:
                for param in group:
                    ranges[param] = opt._get_model_param_range_map(param)["param"]
    count = 0
    head: Head = "score" if score_head else "none" if model.value_head else "lm"
    for param, shard in _hf_shards(model, hf_dir, head):
        main = getattr(param, "main_param", None)
        if main is None:
            continue
        if param in ranges:
            shard = shard.reshape(-1)[ranges[param].start:ranges[param].end]
        main.copy_(shard.reshape(main.shape))
        count += 1
    return count


def _stored_in_bf16(hf_dir: str | os.PathLike) -> bool:
    """Whether every tensor of the checkpoint is stored in bf16 (headers only)."""
    for f in set(_safetensors_files(Path(hf_dir)).values()):
        with safe_open(str(f), framework="pt") as fh:
            if any(fh.get_slice(name).get_dtype() != "BF16" for name in fh.keys()):
                return False
    return True


def _hf_shards(model: LearnerModel, hf_dir: str | os.PathLike, head: Head) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, this rank's shard of it as the checkpoint stores it) for every parameter of this
    rank's chunks the checkpoint holds (`head`: as for `_named_rules`), after checking names and
    shapes (`load_hf_weights`)."""
    hf_dir = Path(hf_dir)
    arch = model.arch
    if read_arch(hf_dir) != arch:
        raise ValueError(f"{hf_dir}/config.json describes another architecture than the model:\n"
                         f"  checkpoint {read_arch(hf_dir)}\n  model      {arch}")
    files = validate_hf_checkpoint(hf_dir, arch, score_head=head == "score")
    tp, rank, _ = _tp()
    for chunk in model.chunks:
        for mname, param, rule, prefix in _named_rules(chunk, arch, head):
            tensors = []
            for suffix in rule.hf:
                with safe_open(str(files[prefix + suffix]), framework="pt") as fh:
                    tensors.append(fh.get_tensor(prefix + suffix))
            shard = to_megatron_shard(tensors, rule, arch, tp, rank, model.padded_vocab_size)
            if shard.shape != param.shape:
                raise ValueError(f"{mname}: shard built from {[prefix + s for s in rule.hf]} has shape "
                                 f"{list(shard.shape)}, the parameter has {list(param.shape)}")
            yield param, shard


@torch.no_grad()
def iter_hf_weights(model: LearnerModel, hf_config=None, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full HF-layout tensor) for this pipeline stage's parameters, one at a time.

    Every rank of the stage must iterate it together: TP shards are all-gathered within the TP
    group, and only the stage's source rank (TP rank 0, DP rank 0) yields; the others yield nothing.
    Ranks with DP rank > 0 take no part (their TP groups are separate) and return at once.
    The vocabulary's padding rows are cut off: every tensor has its HF shape (`expected_hf_shapes`).
    At most one gathered parameter exists at a time; yielded tensors are on the parameters' device
    and may be views into that buffer, so copy them before the next `next()` if you keep them.

    `hf_config` (path/dict/LlamaArch) defaults to the architecture the model was built from.
    `grads=True` yields the gradients (`main_grad` under megatron DDP, else `.grad`) instead.
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return
    arch = model.arch
    if hf_config is not None:
        other = hf_config if isinstance(hf_config, LlamaArch) else read_arch(hf_config)
        if other != arch:
            raise ValueError(f"hf_config describes another architecture than the model: {other} vs {arch}")
    tp, rank, group = _tp()
    for chunk in model.chunks:
        for mname, param, rule, prefix in _named_rules(chunk, arch):
            if rule is _TIED_OUTPUT:
                continue  # the first stage yields the shared embedding
            tensor = param.data
            if grads:
                grad: torch.Tensor | None = getattr(param, "main_grad", None)  # megatron DDP's fp32 buffer
                grad = param.grad if grad is None else grad
                if grad is None:
                    raise RuntimeError(f"{mname} has no gradient")
                tensor = grad
            if rule.split_dim is not None and tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                tensor = torch.cat(parts, dim=rule.split_dim)
                del parts
            if rank == 0:
                yield from zip((prefix + s for s in rule.hf), to_hf(tensor, rule, arch, tp))
