"""Core attention through torch's `scaled_dot_product_attention`, for megatron's local layer spec.

Megatron-core's own `DotProductAttention` (the local spec's core attention) materialises the
[b, heads, s, s] scores: a `baddbmm`, an explicit mask fill, a softmax and a `bmm`, with GQA's keys
and values copied out per query head (`repeat_interleave`). On a CPU that is the learner's
slowest part next to the GEMMs (docs/performance.md); torch's SDPA does the same arithmetic in
one fused, causal, GQA-aware kernel (flash attention on CPU and on CUDA). `SDPAttention` swaps
only that one module: it subclasses megatron's class (same constructor, parameters, sharded state
dict) and replaces `forward`. The Transformer Engine spec (CUDA with TE) has its own fused
attention and does not use this.

What it supports is what our models use: causal self-attention (every mask the learner passes is
the causal one, `learner.schedule._causal_mask`), no dropout, no attention bias or packed
sequences, megatron's "vanilla" softmax; anything else is refused when the layer is built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """megatron's `DotProductAttention` with `forward` done by `F.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        unsupported = {"attn_mask_type": attn_mask_type != AttnMaskType.causal,
                       "attention_dropout": self.attention_dropout.p != 0.0,
                       "softmax_type": config.softmax_type != "vanilla",
                       "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling}
        if any(unsupported.values()):
            raise ValueError(f"SDPAttention supports causal self-attention without dropout, with the vanilla "
                             f"softmax only; unsupported here: {[k for k, bad in unsupported.items() if bad]}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        """[s, b, heads, head_dim] query and [s, b, groups, head_dim] key / value -> [s, b, heads x head_dim]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: no attention bias or packed sequences")
        s, b, heads, head_dim = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads or groups, s, head_dim]
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != heads)
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)
