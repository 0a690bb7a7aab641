"""Build a megatron-core `GPTModel` (this rank's pipeline stage) from an HF LLaMA-family config.

Supported: `model_type` llama (incl. SmolLM2, LLaMA-3.x with `llama3` rope scaling), mistral
without sliding window, and qwen2 (bias on q/k/v). RMSNorm, SwiGLU, RoPE (rotate-half form),
GQA, tied or untied embeddings. Layer spec: Transformer Engine when TE and CUDA are present,
else megatron's local spec. Dtype: the caller's (a run's is `run_plan.model_dtype`: fp32 on CPU unless
AMX or `model.dtype: bfloat16`); None = bf16 on GPU, fp32 on CPU. Params are built on the CPU there.

The architecture is read once into `LlamaArch`, which `learner.mapping` also uses to check an HF
checkpoint's tensor names and shapes against the model before anything is loaded.

Vocabulary padding (megatron's `make_vocab_size_divisible_by`): the embedding and the output layer
are built with `padded_vocab_size(vocab_size, tp, divisible_by)` rows, the HF vocab_size rounded up
to a multiple of divisible_by x TP (default 128, config key `model.make_vocab_size_divisible_by`),
so every TP rank holds an equal, aligned slice of the vocabulary whatever the HF vocab_size (32001,
1003, ...). Rows >= vocab_size are padding: zero (here, and in `learner.mapping`'s HF load), never
looked up (token ids are < vocab_size), their logits set to -inf before any log-softmax
(`learner.logprobs.mask_vocab_padding`, so they get no probability and no gradient and stay zero),
and stripped from every HF-named tensor the learner gives out (`mapping.iter_hf_weights`: HF export
and the weight sync to vLLM). The padded size depends on TP; learner checkpoints still load at any
TP, because megatron-core marks these two tensors `allow_shape_mismatch` (overlapping rows load,
the rest are zero). `LlamaArch.vocab_size` stays the HF value.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron_async.learner.perf import Backend, PerfSettings, ResolvedPerf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
VOCAB_DIVISIBLE_BY = 128  # megatron's default make_vocab_size_divisible_by


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The learner's vocabulary size: `vocab_size` rounded up to a multiple of divisible_by x tp
    (megatron-LM's `_vocab_size_with_padding`). 1 = pad only to a multiple of tp."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"padded_vocab_size needs positive sizes (vocab_size={vocab_size}, tp={tp}, "
                         f"make_vocab_size_divisible_by={divisible_by})")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class LlamaArch:
    """The architecture fields of an HF config.json that decide the model's shapes and math."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: tuple  # sorted (key, value) pairs of the HF rope parameters besides rope_theta
    max_position_embeddings: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def split_problems(self, tp: int, pp: int) -> list[tuple[str, str]]:
        """What stops the model from being split TP x PP, as (axis, why) pairs ("tp", "must divide
        num_attention_heads (9)"); empty if it splits. The vocabulary always splits: it is padded
        to a multiple of TP (`padded_vocab_size`)."""
        sizes = {"tp": (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size)),
                 "pp": (("num_hidden_layers", self.num_layers),)}
        degree = {"tp": tp, "pp": pp}
        return [(axis, f"must divide {name} ({size})") for axis, fields in sizes.items()
                for name, size in fields if size % degree[axis]]

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ValueError if the model cannot be split TP x PP."""
        problems = self.split_problems(tp, pp)
        if problems:
            degree = {"tp": tp, "pp": pp}
            raise ValueError("; ".join(f"{axis}={degree[axis]} {why}" for axis, why in problems))


def read_hf_config(path: str | os.PathLike) -> dict:
    """The config.json of an HF checkpoint dir (or the file itself) as a dict."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no HF config at {path}") from None


def read_arch(hf_config: str | os.PathLike | dict) -> LlamaArch:
    """Parse an HF config (a checkpoint dir, a config.json path, or its dict) into `LlamaArch`.

    Handles both the transformers-4 (`rope_theta` + `rope_scaling`) and transformers-5
    (`rope_parameters`) spellings. Raises ValueError naming the unsupported field.
    """
    cfg = hf_config if isinstance(hf_config, dict) else read_hf_config(hf_config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu/SwiGLU)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if cfg.get("sliding_window") is not None and (model_type == "mistral" or cfg.get("use_sliding_window")):
        raise ValueError(f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported")

    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in rope:  # transformers-4 alias
        rope.setdefault("rope_type", rope.pop("type"))
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3, linear)")

    heads = cfg["num_attention_heads"]
    return LlamaArch(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_theta=rope_theta,
        rope_scaling=tuple(sorted(rope.items())),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
    )


@dataclass
class LearnerModel:
    """This rank's model chunk(s) and what the learner's code needs to know of them, in one record
    (`build_model` makes it; megatron's modules carry nothing of ours).

    `chunks` are this rank's GPTModel pipeline stage(s) (one: no virtual pipeline), raw after
    `build_model`, megatron-DDP-wrapped after `learner.optimizer.build_optimizer` (which returns
    the record with its wrapped chunks); `unwrap_model` reaches the GPTModel either way."""

    chunks: list
    arch: LlamaArch  # the HF architecture (learner.mapping's names and shapes, checkpoints' check)
    padded_vocab_size: int  # rows >= arch.vocab_size of the embedding and output layer are padding
    perf: "ResolvedPerf"  # the performance settings it was built with (learner.optimizer: DDP overlap)
    hf_config: dict | None  # the checkpoint's config.json (written into checkpoints and HF exports)
    value_head: bool = False  # the output layer is a ValueHead (learner/value.py): a value model
    logits_chunk_bytes: int = 0  # the LM head's fp32 logits per chunk, recomputed in the backward; 0 = whole (learner/lm_head.py)


def unwrap_model(chunk):
    """The GPTModel inside megatron wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def transformer_config(arch: LlamaArch, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None,
                       perf: "ResolvedPerf | None" = None, shapes_vary: bool = False):
    """The megatron `TransformerConfig` equivalent to `arch` (dropout off; no CUDA fusions on CPU).

    `perf`: the resolved performance settings (`learner.perf`); default: auto for this machine's
    backend as the run plan finds it (`run_plan.learner_backend`) at `tp` (DP does not matter here).
    Its backend decides CPU vs CUDA choices, so a GPU configuration can be built (and checked) on a
    CPU machine too.
    `shapes_vary`: the microbatches of one pass may differ in [batch, seq] (a token budget,
    trainer.micro_batch_tokens); only then do pipeline stages exchange shapes (`variable_seq_lengths`).
    """
    from megatron.core.transformer import TransformerConfig

    from megatron_async.learner.perf import resolve
    from megatron_async.run_plan import cuda_here, learner_backend

    if perf is None:
        perf = resolve(None, learner_backend(cuda_here()), tp=tp, dp=1, tied_embeddings=arch.tie_word_embeddings)
    cuda = perf.backend.cuda
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    arch.check_parallel(tp, pp)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # TE spec on GPU only: megatron's torch RMSNorm (local spec) asserts it is off (learner/perf.py)
        sequence_parallel=perf.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not cuda,
        # torch.compile'd megatron code on CUDA; eager on CPU.
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        # Only where the kernel exists (TE spec, or the legacy scaled_masked_softmax_cuda extension):
        # the local spec would import that missing extension in bf16.
        masked_softmax_fusion=perf.masked_softmax_fusion,
        # Read only by apex's FusedLayerNorm, which we never use; torch's RMSNorm asserts it is off.
        persist_layer_norm=False,
        apply_rope_fusion=perf.rope_fusion,
        gradient_accumulation_fusion=perf.gradient_accumulation_fusion,
        # gloo has no batched isend/irecv ordering problem to work around, and the sync would
        # call torch.cuda.synchronize, which fails without CUDA.
        batch_p2p_sync=cuda,
        # Microbatches that differ in shape (trainer.micro_batch_tokens): between pipeline stages megatron
        # then sends each activation's shape (3 integers) before it, a shape exchange and a device sync per
        # send, so only when they can differ; by rows every microbatch of a pass has the pass's shape.
        variable_seq_lengths=pp > 1 and shapes_vary,
        # megatron-core refuses variable_seq_lengths with its default MoE token dispatcher (allgather)
        # even for a dense model like ours, which never builds one: naming another passes the check
        moe_token_dispatcher_type="alltoall",
        # HF LLaMA uses the full attention-score precision; keep softmax in fp32.
        attention_softmax_in_fp32=True,
    )


def build_model(hf_config: str | os.PathLike | dict | LlamaArch, dtype: torch.dtype | None = None,
                perf: "PerfSettings | ResolvedPerf | None" = None, backend: "Backend | None" = None,
                make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY, logits_chunk_bytes: int = 0,
                shapes_vary: bool = False) -> LearnerModel:
    """Build this rank's model chunk(s) (one: no virtual pipeline) with random weights (the
    vocabulary's padding rows zero); load real ones with `learner.mapping.load_hf_weights`.

    Needs `learner.parallel.init_parallel` first; TP/PP sizes come from megatron's parallel_state.
    `perf`: the performance settings (`learner.perf.PerfSettings.from_config(cfg.parallel)`; None =
    auto), resolved here for `backend` and this layout (the record's `perf`, where
    `learner.optimizer.build_optimizer` reads the DDP overlap settings).
    `backend`: the learner's device and kernels, the run plan's (`RunPlan.backend`); None = this
    machine's as the plan finds it (`run_plan.learner_backend`: tools and tests without a run).
    `make_vocab_size_divisible_by`: the vocabulary is padded to a multiple of it x TP (module
    docstring; the record's `padded_vocab_size`).
    `logits_chunk_bytes`: the record's; `trainer.logits_chunk_mb` (learner/lm_head.py).
    `shapes_vary`: microbatches of one pass may differ in shape (`transformer_config`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_async.learner.attention import SDPAttention
    from megatron_async.learner.lm_head import defer_lm_head
    from megatron_async.learner.perf import ResolvedPerf, resolve
    from megatron_async.run_plan import cuda_here, learner_backend

    if isinstance(hf_config, LlamaArch):
        arch, raw = hf_config, None
    else:
        raw = hf_config if isinstance(hf_config, dict) else read_hf_config(hf_config)
        arch = read_arch(raw)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if not isinstance(perf, ResolvedPerf):
        backend = backend or learner_backend(cuda_here())
        perf = resolve(perf, backend, tp=tp, dp=parallel_state.get_data_parallel_world_size(),
                       tied_embeddings=arch.tie_word_embeddings)
    config = transformer_config(arch, tp, pp, dtype, perf=perf, shapes_vary=shapes_vary)
    vocab = padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by)
    if perf.backend.te:
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:  # megatron's local spec with torch's fused SDPA as its core attention (learner/attention.py)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = SDPAttention

    rope = dict(arch.rope_scaling)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # logits stay vocab-parallel; see learner.logprobs
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        seq_len_interpolation_factor=rope["factor"] if arch.rope_type == "linear" else None,
    )
    if arch.rope_type == "llama3":
        # GPTModel only takes the llama3 `factor`; megatron hard-codes the other three parameters
        # to LLaMA-3.1's values. Recompute inv_freq with the checkpoint's own values.
        rot = model.rotary_pos_emb
        dim = arch.head_dim
        base = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim))
        rot.inv_freq = rot._apply_scaling(
            base,
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    if config.bf16:
        # Every parameter in bf16, as megatron-LM's Float16Module makes them (`module.bfloat16()`):
        # the local spec's torch RMSNorm is built in fp32 whatever params_dtype says, and megatron's
        # mixed-precision optimizer checkpoints only its bf16 params' state (fp32 ones break its
        # sharded state dict). Not the wrapper itself: it would cast the hidden states the deferred
        # LM head gets (learner/lm_head.py) to fp32.
        model.bfloat16()
    _zero_vocab_padding(model, arch.vocab_size, vocab, tp)
    defer_lm_head(model)  # the loss projects the hidden states itself (learner/lm_head.py)
    if torch.cuda.is_available() and perf.backend.cuda:  # not one resolved for the CPU (plan-sync's, on meta)
        model.cuda(torch.cuda.current_device())
    return LearnerModel([model], arch, vocab, perf, raw, logits_chunk_bytes=logits_chunk_bytes)


def vocab_shard_real_rows(vocab_size: int, padded: int, tp: int, rank: int) -> int:
    """How many of TP rank `rank`'s `padded // tp` vocabulary rows are real (< vocab_size);
    megatron gives rank r the contiguous rows [r * padded / tp, (r + 1) * padded / tp)."""
    per_rank = padded // tp
    return max(0, min(per_rank, vocab_size - rank * per_rank))


@torch.no_grad()
def _zero_vocab_padding(model, vocab_size: int, padded: int, tp: int) -> None:
    """Zero this rank's padding rows of the embedding and the (untied) output layer."""
    if padded == vocab_size:
        return
    from megatron.core import parallel_state

    real = vocab_shard_real_rows(vocab_size, padded, tp, parallel_state.get_tensor_model_parallel_rank())
    for owner in ("embedding", "output_layer"):
        module = getattr(model, owner, None)
        weight = getattr(getattr(module, "word_embeddings", module), "weight", None)
        if weight is not None:
            weight[real:].zero_()
