"""rollout.weight_transport=nccl: the broadcast sender (weights/broadcast.py) over vLLM's PyNccl
communicator into a GPU replica running `mas_nccl` (vLLM's NCCL engine, weights/engines.py).

The fast test checks what each `/update_weights` call tells the replica's engine (it sizes its
receive buffers from it). Everything else of this path but the CUDA communicator runs in CI over
gloo (tests/test_gloo_wire.py). The GPU test needs CUDA, vLLM and two GPUs: NCCL refuses two ranks
of one group on the same device (init.cc: "Duplicate GPU detected" -> ncclInvalidUsage), so the
sender stays on cuda:0 and the replica gets cuda:1. No machine of this project has run it (the
lent GPU is one H200 without vLLM).
"""
from __future__ import annotations

import functools
import importlib.util
import socket

import pytest
import torch

from megatron_async.weights.broadcast import update_info


def test_update_info_names_dtypes_and_shapes_of_a_bucket():
    bucket = [("model.embed_tokens.weight", torch.zeros(7, 4, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.zeros(7, 4, dtype=torch.float16))]
    assert update_info(bucket) == {
        "names": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
        "dtype_names": ["bfloat16", "float32", "float16"],  # getattr(torch, name) on the replica
        "shapes": [[7, 4], [4], [7, 4]],
        "keep": False,  # the replica keeps what it loads only for delta sync (weights/delta.py)
        "group": 0,  # the pipeline stage whose group carries the tensors
    }
    assert update_info(bucket, keep=True)["keep"] is True
    assert update_info(bucket, group=3)["group"] == 3
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in update_info(bucket)["dtype_names"])


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None,
                    reason="needs vLLM and 2 GPUs (NCCL refuses sender and replica on one device)")
def test_nccl_push_into_a_gpu_replica_matches_transformers(tiny_models, tmp_path):
    from megatron_async.rollout import ReplicaPool, Sampling
    from megatron_async.weights.broadcast import BroadcastSender, make_wire
    from tests.rollout_fixtures import LOGPROB_TOL, max_logprob_diff, spec, state_dict

    torch.cuda.set_device(0)
    learner_stream = torch.cuda.current_stream()
    prompts = [[1, 5 + i, 6] for i in range(4)]
    with ReplicaPool(spec(tiny_models[0], weight_backend="mas_nccl", kv_cache_bytes=None), 1, log_dir=tmp_path,
                     devices=["1"]) as pool:
        sender = BroadcastSender(pool.urls, pool.key, wire=make_wire("nccl"), replica_tp=1, timeout_s=120,
                                 bucket_bytes=48 << 10)
        try:
            for version, model in ((1, tiny_models[1]), (2, tiny_models[2])):  # the second push reuses the group
                opened = pool.begin_update(None, "between_batches", 120)
                named = ((k, v.cuda()) for k, v in state_dict(model).items())
                result = sender.push(named, urls=[pool.urls[i] for i in opened])
                assert not result.failed and result.buckets > 1, result
                assert torch.cuda.current_stream() == learner_stream  # vLLM's warm-up kept off the learner's thread
                assert pool.finish_update(version, opened) == [0]
                records = pool.generate(prompts, Sampling(n=2, max_tokens=8, seed=0))
                assert {r.policy_version for r in records} == {version}
                assert max_logprob_diff(model, records) < LOGPROB_TOL
        finally:
            sender.close()


def test_the_rendezvous_address_is_the_one_this_host_uses_towards_the_replica():
    """Not the host name, which may resolve to 127.0.1.1 (Debian's /etc/hosts) or another interface."""
    import psutil

    from megatron_async.weights.broadcast import address_towards

    assert address_towards("http://127.0.0.1:8000") == "127.0.0.1" == address_towards("http://localhost:8000")
    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert own, f"this test needs a non-loopback IPv4 address: {psutil.net_if_addrs()}"
    assert address_towards(f"http://{own[0]}:8000") == own[0]  # the route to this host's own address leaves from it


class RecordingGroup:
    """A stand-in communicator: what was broadcast over it, and whether it was destroyed."""

    def __init__(self, group: int):
        self.group, self.destroyed = group, False
        self.received: list[tuple[int, ...]] = []

    def broadcast(self, tensor, src, stream=None):
        tensor.fill_(float(self.group))  # "receives" its group's number
        self.received.append(tuple(tensor.shape))

    def destroy(self):
        self.destroyed = True


@pytest.mark.integration  # in-process, but importing vLLM starts a process (its platform probe runs `file`)
def test_the_engine_holds_one_group_per_pipeline_stage_and_receives_each_bucket_over_its_own():
    """mas_gloo / mas_nccl's side of a PP learner (fakes for the groups and the model): groups keyed
    by stage side by side, a group formed again replaces only its stage's, a bucket is read from the
    group it names, and a bucket for a stage with no group is refused naming those formed."""
    from megatron_async.weights.delta import DeltaDecoder
    from megatron_async.weights.engines import BroadcastInitInfo, BroadcastUpdateInfo, MasGlooEngine, UpdateCoverage

    class Engine(MasGlooEngine):
        def join_group(self, init_info):
            return RecordingGroup(init_info.group)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
            self.loaded = []

        def load_weights(self, weights):
            self.loaded += [(name, float(t.flatten()[0])) for name, t in weights]
            return {name for name, _ in weights}

    engine = Engine.__new__(Engine)  # vLLM's constructor wants a running model; the groups' logic does not
    engine.groups, engine.device, engine.model = {}, torch.device("cpu"), Model()
    engine.coverage, engine.deltas, engine.group_infos = UpdateCoverage(), DeltaDecoder(), {}
    info = functools.partial(BroadcastInitInfo, master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    engine.init_transfer_engine(info(group=0))
    engine.init_transfer_engine(info(group=1))
    first = engine.groups[1]
    engine.init_transfer_engine(info(group=1))  # stage 1's sender re-formed its group
    assert first.destroyed and not engine.groups[0].destroyed and sorted(engine.groups) == [0, 1]
    engine.coverage.start(engine.model)  # one update session, both stages' buckets in it
    engine.receive_weights(BroadcastUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[2], [3]], group=1))
    engine.receive_weights(BroadcastUpdateInfo(names=["c"], dtype_names=["float32"], shapes=[[4]], group=0))
    assert engine.groups[1].received == [(2,), (3,)] and engine.groups[0].received == [(4,)]
    assert engine.model.loaded == [("a", 1.0), ("b", 1.0), ("c", 0.0)]
    engine.receive_weights(BroadcastUpdateInfo(names=[], dtype_names=[], shapes=[], verify=True))  # covered by both
    with pytest.raises(RuntimeError, match=r"group 4 not formed \(groups formed: \[0, 1\]\)"):
        engine.receive_weights(BroadcastUpdateInfo(names=["d"], dtype_names=["float32"], shapes=[[1]], group=4))
    groups = list(engine.groups.values())
    engine.shutdown()
    assert all(g.destroyed for g in groups) and engine.groups == {}
