"""`learner.logprobs.token_logprobs` over a deferred LM head (learner/lm_head.py): the logits made a
chunk at a time give the same logprobs and gradients as the whole, and the forward-only path is a
log-softmax over the real vocabulary. One TP rank, in process; the real GPTModel path runs in
tests/test_learner_parity.py, test_vocab_padding.py and test_learner_regression.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import pytest
import torch

from megatron_async.learner.lm_head import LMHead
from megatron_async.learner.logprobs import token_logprobs
from megatron_async.learner.model import padded_vocab_size


@dataclass
class LinearHead:
    """An LM head of one TP rank: hidden [s', b', h] -> logits [s', b', vocab] (learner.lm_head.LMHead's interface)."""

    weight: torch.Tensor
    sequence_parallel: bool = False  # at TP = 1 the sequence gather is the identity; it only moves the chunking to rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

    @property
    def vocab_per_rank(self) -> int:
        return self.weight.shape[0]


def linear_head(weight: torch.Tensor, sequence_parallel: bool = False) -> LMHead:
    """A LinearHead where token_logprobs takes an LMHead (it uses only the interface they share)."""
    return cast(LMHead, LinearHead(weight, sequence_parallel))


@pytest.fixture
def one_tp_rank(one_rank_group, monkeypatch):
    """megatron's parallel_state as one TP rank over the one-rank gloo group (its cross-entropy all-reduces)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import cross_entropy

    for module in (ps, cross_entropy):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(module, "get_tensor_model_parallel_group", lambda: one_rank_group)


def reference(hidden, weight, ids, vocab, temperature):
    """log p(token t | prefix) from the whole logits: a log-softmax over the real vocabulary."""
    logits = torch.nn.functional.linear(hidden, weight)[..., :vocab] / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("chunk_slices", [1, 2, 3, 100])
def test_chunked_logprobs_and_gradients_equal_the_whole(one_tp_rank, chunk_slices, sequence_parallel):
    """Whatever the chunk size (one slice of positions, or of rows under sequence parallelism, up to
    all of them), logprobs with and without gradients, and the gradients of the hidden states and of
    the head's weight, equal the whole log-softmax's; padded vocabulary rows take no probability."""
    b, s, h, vocab, temperature = 3, 7, 5, 37, 0.7
    padded = padded_vocab_size(vocab, 1, 8)  # 40: three padding rows
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(padded, h, generator=gen)
    weight[vocab:] = 3.0  # padding rows with large logits: they would take mass if not masked
    hidden = torch.randn(b, s, h, generator=gen)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    upstream = torch.randn(b, s, generator=gen)  # a loss's gradient per token
    chunk_bytes = chunk_slices * (s if sequence_parallel else b) * padded * 4

    def run(fn):
        w, x = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
        lp = fn(x, w)
        (lp * upstream).sum().backward()
        return lp.detach(), x.grad, w.grad

    want = run(lambda x, w: reference(x, w, ids, vocab, temperature))
    got = run(lambda x, w: token_logprobs(x, ids, linear_head(w, sequence_parallel), temperature, vocab, chunk_bytes))
    with torch.no_grad():
        got_no_grad = token_logprobs(hidden, ids, linear_head(weight, sequence_parallel), temperature, vocab, chunk_bytes)
    assert torch.all(got[0][:, 0] == 0) and torch.all(got_no_grad[:, 0] == 0)
    for name, g, w in zip(("logprobs", "hidden grad", "weight grad"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert got[2][vocab:].abs().max() == 0  # no gradient into the padding rows
    torch.testing.assert_close(got_no_grad, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab, temperature", [(301, 1.0), (296, 1.0), (296, 0.7)])
def test_forward_only_logprobs_equal_a_log_softmax_over_the_real_vocabulary(vocab, temperature, one_tp_rank):
    """The no-grad path (reference / old-policy logprobs: max, sum of exp and the target's logit,
    padding columns sliced off) gives the log-softmax over the real vocabulary at the next token,
    aligned like the training path (position 0 is 0)."""
    padded = padded_vocab_size(vocab, 1)
    hidden = torch.randn(2, 6, 16) * 3
    weight = torch.randn(padded, 16)
    weight[vocab:] = 0.0
    hidden[..., 0], weight[vocab:, 0] = 1.0, 9.0  # padding logits of 9: they would take mass if not left out
    ids = torch.randint(0, vocab, (2, 6))
    with torch.no_grad():
        got = token_logprobs(hidden, ids, linear_head(weight), temperature=temperature, vocab_size=vocab)
    assert got.shape == ids.shape and torch.all(got[:, 0] == 0)
    torch.testing.assert_close(got, reference(hidden, weight, ids, vocab, temperature), rtol=0, atol=1e-4)
