"""`megatron-async bench lm-head`: the LM head's logprobs, whole against chunked (`trainer.logits_chunk_mb`), alone, at SmolLM2's size.

    taskset -c 1 megatron-async bench lm-head [CHUNK_MB ...]      # default: 8 16 31 0

`learner.logprobs.token_logprobs` on random hidden states [8, 216, 576] (a SmolLM2 micro batch of 8
rows: 120 prompt + 96 completion tokens) with a 49,152 x 576 head, one TP rank, one torch thread,
temperature 0.7: the forward-only pass (reference / old-policy logprobs) and the training pass
(forward and backward); per chunk size (0 = whole), the best of 3 in seconds and the minor page
faults per pass (`getrusage`). One JSON line per case.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import cross_entropy

from megatron_async.learner.lm_head import LMHead
from megatron_async.learner.logprobs import token_logprobs

ROWS, POSITIONS, HIDDEN, VOCAB = 8, 216, 576, 49152


@dataclass
class LinearHead:
    """One TP rank's LM head (learner.lm_head.LMHead's interface) over a plain weight."""

    weight: torch.Tensor
    sequence_parallel: bool = False

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

    @property
    def vocab_per_rank(self) -> int:
        return self.weight.shape[0]


def one_tp_rank() -> None:
    """megatron's parallel_state as one TP rank over a one-rank gloo group (its cross-entropy all-reduces)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for module in (ps, cross_entropy):
        module.get_tensor_model_parallel_world_size = lambda: 1
        module.get_tensor_model_parallel_rank = lambda: 0
        module.get_tensor_model_parallel_group = lambda: dist.group.WORLD


def measure(chunk_mb: int, grad: bool, weight: torch.Tensor, ids: torch.Tensor, reps: int = 3) -> dict:
    seconds, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        w = weight.clone().requires_grad_(grad)
        hidden = torch.randn(ROWS, POSITIONS, HIDDEN).requires_grad_(grad)
        t = time.perf_counter()
        with torch.set_grad_enabled(grad):
            logprobs = token_logprobs(hidden, ids, cast(LMHead, LinearHead(w)), 0.7, VOCAB, chunk_mb << 20)  # LMHead's interface
            if grad:
                logprobs.sum().backward()
        seconds.append(time.perf_counter() - t)
    return {"chunk_mb": chunk_mb, "pass": "training" if grad else "forward-only", "seconds": min(seconds),
            "minor_faults_per_pass": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // reps}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    one_tp_rank()
    weight = torch.randn(VOCAB, HIDDEN) * 0.02
    ids = torch.randint(0, VOCAB, (ROWS, POSITIONS))
    for grad in (False, True):
        for chunk_mb in [int(a) for a in argv] or [8, 16, 31, 0]:
            print(json.dumps(measure(chunk_mb, grad, weight, ids)), flush=True)
    dist.destroy_process_group()
    return 0
