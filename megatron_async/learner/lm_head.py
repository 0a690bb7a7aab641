"""The policy's LM head, deferred to the loss: per-token logprobs without [s, b, vocab] logits.

GPTModel ends with `logits, _ = self.output_layer(hidden, weight=..., runtime_gather_output=...)`
and returns `logits.transpose(0, 1)`: every microbatch materialises its whole vocab-parallel logits
(fp32 [s, b, vocab / TP]), then a transposed copy of them, and the cross-entropy's softmax and
gradient of the same size. With SmolLM2's 49,152-word vocabulary a micro batch of 8 x 216 tokens
makes four 340 MB tensors per pass, each one a fresh mapping of memory on CPU (page faults: docs/performance.md); with LLaMA-3's 128k vocabulary, an 8k-token microbatch's are 4 GB each.

`DeferredOutputLayer` is megatron's `ColumnParallelLinear` (the output layer GPTModel built, the
same parameters, sharded state dict and TP/sequence-parallel behaviour) whose `forward` returns the
final-normed hidden states unchanged; `project` is the original forward, which
`learner.logprobs.token_logprobs` calls and hands straight to the cross-entropy in megatron's
[s, b] layout, so the transposed copy is never made (what that saves: docs/performance.md). With `trainer.logits_chunk_mb` it projects chunks of
tokens instead, recomputed in the backward, so that at most one chunk's logits exist at a time: a
bound on memory for large vocabularies, paid with one more LM-head GEMM. The swap changes the class of the layer
GPTModel built, in place (`defer_lm_head`), rather than building another: GPTModel's set-up has
already tied it to the embedding (the shared weight's flags, its pipeline all-reduce group), and a
subclass keeps all of that. The value model swaps the same layer for its `ValueHead`
(learner/value.py), with the same calling convention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear


class DeferredOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer with the projection left to the loss (module docstring)."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """[s, b, hidden] final hidden states (under sequence parallelism this rank's [s / TP, b,
        hidden]) -> the same tensor, and no bias: GPTModel returns them as [b, s, hidden]."""
        return input_, None

    def project(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[s', b', hidden] -> [s', b', vocab / TP] logits: the output layer's own forward (under
        sequence parallelism it gathers the sequence first, so s' is then the whole sequence)."""
        logits, _ = super().forward(hidden, weight=weight)
        return logits


def defer_lm_head(gpt) -> None:
    """Make the last pipeline stage's output layer of GPTModel `gpt` a `DeferredOutputLayer`."""
    if gpt.post_process:
        if gpt.config.mtp_num_layers:
            raise NotImplementedError("multi-token prediction calls the output layer itself; not supported")
        if type(gpt.output_layer) is not ColumnParallelLinear:
            raise TypeError(f"expected GPTModel's ColumnParallelLinear output layer, got {type(gpt.output_layer).__name__}")
        gpt.output_layer.__class__ = DeferredOutputLayer


@dataclass(frozen=True)
class LMHead:
    """The projection of one GPTModel's deferred output layer, and what a chunker needs to know."""

    layer: DeferredOutputLayer
    weight: torch.Tensor | None  # the shared embedding weight where the embeddings are tied, as GPTModel passes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s', b', hidden] -> [s', b', vocab / TP] logits (`DeferredOutputLayer.project`)."""
        return self.layer.project(hidden, weight=self.weight)

    @property
    def vocab_per_rank(self) -> int:
        return self.layer.output_size_per_partition

    @property
    def sequence_parallel(self) -> bool:
        """The projection gathers the sequence over TP ranks (its input is this rank's s / TP)."""
        return self.layer.sequence_parallel


def lm_head(gpt) -> LMHead:
    """The LM head of GPTModel `gpt`, whose output layer `defer_lm_head` deferred."""
    layer = gpt.output_layer
    if not isinstance(layer, DeferredOutputLayer):
        raise TypeError(f"{type(layer).__name__} is not a deferred LM head (learner.lm_head.defer_lm_head)")
    return LMHead(layer, gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None)


def whole_logits(gpt, hidden: torch.Tensor) -> torch.Tensor:
    """[b, s, hidden] output of GPTModel `gpt` -> its [b, s, vocab / TP] logits, all at once: what
    GPTModel returns without the deferral (parity checks; the learner's passes project inside the loss)."""
    return lm_head(gpt)(hidden.transpose(0, 1)).transpose(0, 1)
