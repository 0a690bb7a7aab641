"""rollout.weight_transport=nccl: weights/nccl_sender.py over vLLM's own `nccl` weight-transfer backend.

The fast test checks what each `/update_weights` call tells the replica's NCCL engine (it sizes its
receive buffers from it). The GPU test runs a real vLLM server on the GPU with
`--weight-transfer-config '{"backend": "nccl"}'`, pushes other weights twice through the sender's
persistent group and compares the sampled tokens' logprobs with transformers'. It needs CUDA and
vLLM; none of this project's machines has both (the lent GPU's image has no vLLM), so it has not run.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_async.weights.nccl_sender import update_info


def test_update_info_names_dtypes_and_shapes_of_a_bucket():
    bucket = [("model.embed_tokens.weight", torch.zeros(7, 4, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.zeros(7, 4, dtype=torch.float16))]
    assert update_info(bucket) == {
        "names": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        "dtype_names": ["bfloat16", "float32", "float16"],  # getattr(torch, name) on the replica
        "shapes": [[7, 4], [4], [7, 4]],
    }
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in update_info(bucket)["dtype_names"])


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs CUDA and vLLM (a GPU replica with vLLM's nccl backend)")
def test_nccl_push_into_a_gpu_replica_matches_transformers(tiny_models, tmp_path):
    from megatron_async.rollout import ReplicaPool, Sampling
    from megatron_async.weights.nccl_sender import NcclSender
    from tests.rollout_fixtures import LOGPROB_TOL, max_logprob_diff, spec, state_dict

    prompts = [[1, 5 + i, 6] for i in range(4)]
    with ReplicaPool(spec(tiny_models[0], weight_backend="nccl", kv_cache_bytes=None), 1, log_dir=tmp_path) as pool:
        sender = NcclSender(pool.urls, pool.key, address="127.0.0.1", replica_tp=1, timeout_s=120, bucket_bytes=48 << 10)
        try:
            for version, model in ((1, tiny_models[1]), (2, tiny_models[2])):  # the second push reuses the group
                opened = pool.begin_update(None, "between_batches", 120)
                named = ((k, v.cuda()) for k, v in state_dict(model).items())
                metrics = sender.push(named, urls=[pool.urls[i] for i in opened])
                assert not metrics["failed"] and metrics["buckets"] > 1, metrics
                assert pool.finish_update(version, opened) == [0]
                records = pool.generate(prompts, Sampling(n=2, max_tokens=8, seed=0))
                assert {r.policy_version for r in records} == {version}
                assert max_logprob_diff(model, records) < LOGPROB_TOL
        finally:
            sender.close()
