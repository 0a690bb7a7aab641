"""The PPO value model: the policy's megatron-core GPTModel with a scalar head instead of the LM head.

    model = build_value_model(init_model)      # this rank's stage, the policy's initial trunk, zero head
    model = build_value_model(rm_dir, from_reward_model=True)   # the reward model's trunk and head
    ddp, optimizer, scheduler = learner.optimizer.build_optimizer(model, settings)
    values = learner.schedule.compute_values(ddp, microbatches)   # [b, s] per microbatch

Design: the same `GPTModel` as the policy (built and loaded by `learner.model.build_model` and
`learner.mapping.load_hf_weights`, so TP/PP sharding, the pipeline schedule, DDP, the optimizer
and `dist_checkpointing` are the policy's own), whose `output_layer` on the last stage is swapped
for `ValueHead`. GPTModel calls `output_layer(hidden, weight=..., runtime_gather_output=...)` on
the final-normed hidden states and transposes its output to [b, s, ...], so the head's [s, b, 1]
comes out as [b, s, 1] with no other change to megatron. Alternatives were worse: building with
`post_process=False` skips the final RMSNorm too, and a vocab-sized LM head kept beside a head
would waste vocab x hidden weights and Adam state.

The head is `Linear(hidden, 1)` REPLICATED over TP: every TP rank holds the full final hidden
states (with sequence parallelism, `parallel.sequence_parallel`, the head first gathers the
sequence shards, as the LM head's ColumnParallelLinear does, and its backward splits the gradient
back without summing the identical copies), so every rank computes the same values and the same
head gradients (megatron counts a parameter without `tensor_model_parallel` once in the grad norm).
Initial weights, as the paper and TRL's PPO do: with a reward model (`reward.kind: reward_model`,
an HF one-label `*ForSequenceClassification` checkpoint), its trunk and its `score.weight` as the
head's weight, bias 0, so V_old at a sequence's last token is the RM's score of it; the RM's
architecture may differ from the policy's (any LLaMA-family model that splits at the run's TP x PP;
`config.validate` checks, naming `reward.model_path`) but it reads the policy's token ids, so it
must share the policy's tokenizer (`trainer.build_learner` compares the vocabulary sizes). Without
one (exact-match rewards), the policy's initial (SFT) trunk and a zero head (V = 0 everywhere,
identical on every rank without an RNG). Embeddings are untied in the value model (its head has
its own weights), so no embedding gradient is all-reduced between pipeline stages.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_async.learner.mapping import load_hf_weights
from megatron_async.learner.model import VOCAB_DIVISIBLE_BY, LearnerModel, build_model


class ValueHead(torch.nn.Module):
    """[s, b, hidden] -> ([s, b, 1], None): the call signature of GPTModel's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False):
        super().__init__()
        # named weight/bias like the LM head's: LanguageModule.sharded_state_dict looks them up
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward: split, not reduce-scatter

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def build_value_model(hf_dir, from_reward_model: bool = False, dtype: torch.dtype | None = None, perf=None,
                      backend=None, make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY,
                      shapes_vary: bool = False) -> LearnerModel:
    """This rank's value model (`value_head` set): the trunk of the HF checkpoint `hf_dir` and a
    `ValueHead` on the last stage, zero, or with `from_reward_model` (a one-label sequence
    classifier) its `score.weight`. `dtype`, `perf`, `backend`, `make_vocab_size_divisible_by`, `shapes_vary`: as for
    `learner.model.build_model` (the policy's settings; the embedding is padded like the policy's)."""
    model = build_model(hf_dir, dtype=dtype, perf=perf, backend=backend,
                        make_vocab_size_divisible_by=make_vocab_size_divisible_by, shapes_vary=shapes_vary)
    if not from_reward_model:
        load_hf_weights(model, hf_dir)  # before the swap: the policy's checkpoint has an LM head, not ours
    for chunk in model.chunks:
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            p = next(chunk.parameters())
            chunk.output_layer = ValueHead(chunk.config.hidden_size, p.dtype, p.device,
                                           sequence_parallel=chunk.config.sequence_parallel)
    model = dataclasses.replace(model, value_head=True)
    if from_reward_model:
        load_hf_weights(model, hf_dir, score_head=True)  # after the swap: score.weight -> the head
    return model
