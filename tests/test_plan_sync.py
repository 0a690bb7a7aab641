"""`megatron-async plan-sync` (weights/plan.py): the planner's stages, bytes, calls and links, in
process (fast tier). Its bytes are checked against a real megatron model's parameters; its layout
against the shipped recipes' own overrides (launch/slurm_llama*.sbatch)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state

from megatron_async import cli
from megatron_async.config import load_config
from megatron_async.transports import sync_bucket_bytes
from megatron_async.learner.model import build_model, unwrap_model
from megatron_async.weights.update import group_by_cap
from megatron_async.weights.plan import PHASE_CALLS, Links, SyncPlan, packed_buffers, plan_sync, stage_tensors

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
# 4 layers, vocab a multiple of 128 (no padding rows: the model's parameters are exactly its HF tensors)
TINY = dict(model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
RHO1B = str(ROOT / "configs" / "gpu_rho1b_gsm8k.yaml")  # a shipped one-node GPU config
ONE_NODE = ["placement.gpus_per_node=8", "placement.learner_gpus=[0,1,2,3]", "model.dtype=bfloat16"]


def tiny_dir(root: Path, **changes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY | changes))
    return root


def plan(*overrides: str, config: str | None = None, links: Links = Links()) -> SyncPlan:
    return plan_sync(load_config(config, list(overrides)), links)


def recipe_layout(script: str) -> list[str]:
    """The overrides a SLURM recipe gives its config (its LAYOUT=(...) array)."""
    layout = re.search(r"^LAYOUT=\((.*?)\)$", (ROOT / "launch" / script).read_text(), re.M | re.S)
    assert layout, f"no LAYOUT=(...) in launch/{script}"
    return layout.group(1).split()


@pytest.fixture(scope="module")
def megatron_one_rank(one_rank_group):
    """megatron's parallel state of one rank (TP = PP = 1) in this process, for a real model."""
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_each_stage_sends_its_parameters_bytes(megatron_one_rank, tmp_path, tied, pp):
    """A stage's bytes are those of the parameters its megatron stage holds (layers split evenly,
    the embedding on the first, the final norm and an untied head on the last), in the replicas'
    bf16; a real model's parameters, built here, are the reference."""
    hf = tiny_dir(tmp_path / "m", tie_word_embeddings=tied)
    model = unwrap_model(build_model(str(hf)).chunks[0])  # real CPU tensors, TP = PP = 1
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    per_stage = TINY["num_hidden_layers"] // pp
    want = []
    for stage in range(pp):
        layers = model.decoder.layers[stage * per_stage:(stage + 1) * per_stage]
        count = sum(numel(layer) for layer in layers)
        count += numel(model.embedding) if stage == 0 else 0
        count += numel(model.decoder.final_layernorm) if stage == pp - 1 else 0
        count += numel(model.output_layer) if stage == pp - 1 and not tied else 0
        want.append(2 * count)  # bf16
    got = plan(*ONE_NODE, f"model.hf_path={hf}", f"parallel.pp={pp}")
    assert [s.bytes for s in got.stages] == want
    assert [list(s.layers) for s in got.stages] == [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]
    assert got.bytes == sum(want) and got.parameters == sum(want) // 2


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_broadcast_transports_call_each_replica_once_per_stage(tmp_path, transport):
    """Over nccl and gloo a stage's whole manifest is one /update_weights per replica however many
    buffers it fills; a push is the stages plus the pool's phase calls. Host memory: one call per buffer."""
    hf = tiny_dir(tmp_path / "m")
    layout = [*ONE_NODE, f"model.hf_path={hf}", "parallel.pp=2", "rollout.num_replicas=2", "rollout.sync_bucket_mb=1"]
    broadcast = plan(*layout, f"rollout.weight_transport={transport}")
    assert [s.calls_per_replica for s in broadcast.stages] == [1, 1]
    assert all(s.buffers > 1 for s in broadcast.stages)  # several buffers, still one call
    assert broadcast.calls_per_replica == 2 + len(PHASE_CALLS)
    shm = plan(*layout, "rollout.weight_transport=shm")
    assert [s.calls_per_replica for s in shm.stages] == [s.buffers for s in shm.stages]
    assert all(s.buffers > 1 for s in shm.stages)
    assert {s.carrier for s in shm.stages} == {"shm"} and shm.seconds is None


def recipe_8b(**kwargs) -> SyncPlan:
    return plan(*recipe_layout("slurm_llama8b.sbatch"), f"model.hf_path={FIXTURES / 'llama-3.1-8b'}",
                "placement.nnodes=2", "placement.gpus_per_node=8", "rollout.host=10.0.0.2", "rollout.base_port=8100",
                config=str(ROOT / "configs" / "gpu_llama8b_norobots.yaml"), **kwargs)


def test_the_8b_recipe_crosses_into_the_replica_node_once(monkeypatch):
    """launch/slurm_llama8b.sbatch, as built: the one sender on node 0 reaches node 1's eight TP=1
    replicas through one group of 1 + 8 ranks (a node group, weights/broadcast.py), so its 16.06 GB
    cross InfiniBand once; seconds as computed. The default bucket (auto) is 1024 MiB."""
    monkeypatch.setenv("MEGATRON_ASYNC_ROLLOUT_TOKEN", "x")
    links = Links(nvlink_gb_per_s=400.0, infiniband_gb_per_s=40.0, call_overhead_s=0.01)
    got = recipe_8b(links=links)
    [stage] = got.stages
    assert got.bucket_mb == 1024 and "per (stage, replica node)" in got.render()
    assert (stage.sender_rank, stage.sender_node, stage.calls_per_replica) == (0, 0, 1)
    assert [(g.node, g.replicas, g.ranks, g.link) for g in stage.groups] == [(1, list(range(8)), 9, "infiniband")]
    assert stage.bytes == 2 * 8_030_261_248  # LLaMA-3.1-8B's parameters in bf16
    assert stage.seconds is not None  # modelled: nccl
    assert stage.seconds == pytest.approx(stage.bytes / 40e9 + 0.01)
    assert got.seconds == pytest.approx(stage.seconds + len(PHASE_CALLS) * 0.01)
    assert "InfiniBand node 0->1, once" in got.render()


@pytest.mark.parametrize("bucket_mb", [1, 2])
def test_broadcast_buffers_follow_vllms_packing_rule(tmp_path, bucket_mb):
    """Over nccl a stage's buffers are those vLLM's packed producer fills, not `group_by_cap`'s (shm):
    the tensor that crosses the cap stays in the buffer, so a buffer exceeds the cap."""
    hf = tiny_dir(tmp_path / "m")
    layout = [*ONE_NODE, f"model.hf_path={hf}", f"rollout.sync_bucket_mb={bucket_mb}"]
    nccl, shm = plan(*layout, "rollout.weight_transport=nccl"), plan(*layout, "rollout.weight_transport=shm")
    [(_, tensors)] = stage_tensors(json.loads((hf / "config.json").read_text()), 1, 1)
    cap, total = bucket_mb << 20, 0
    buffers: list[int] = []
    for _, t in tensors:  # the rule, written out here on its own
        total += 2 * t.numel()  # bf16
        if total > cap:
            buffers, total = buffers + [total], 0
    buffers += [total] if total else []
    assert nccl.stages[0].buffers == len(buffers) and nccl.bucket_mb == bucket_mb
    assert len(buffers) > 1 and max(buffers) > cap  # a buffer holds the tensor that crossed the cap
    assert shm.stages[0].buffers == sum(1 for _ in group_by_cap([(n, t.bfloat16()) for n, t in tensors], cap))


@pytest.mark.integration  # in-process, but importing vLLM starts a process
def test_packed_buffers_counts_what_vllms_pack_tensors_fills():
    """`packed_buffers` against vLLM's own `pack_tensors`, on meta tensors of mixed sizes."""
    from megatron_async.weights import vllm_plugin

    sizes = [300, 300, 10, 500, 1, 1, 2000, 499, 1, 7]
    for cap in (1, 300, 500, 600, 1000, 5000):
        stream = iter([(str(i), torch.empty(n, dtype=torch.uint8, device="meta")) for i, n in enumerate(sizes)])
        filled = 0
        while vllm_plugin.packed_tensor().pack_tensors(stream, lambda item: item[1], cap) is not None:
            filled += 1
        assert packed_buffers(sizes, cap) == filled, cap


def test_the_default_bucket_is_resolved_per_transport(tmp_path):
    """rollout.sync_bucket_mb=auto (the default): 1024 MiB over nccl / gloo, 64 over shm, as a run
    resolves it (transports.sync_bucket_bytes)."""
    hf = tiny_dir(tmp_path / "m")
    for transport in ("nccl", "gloo", "shm"):
        got = plan(*ONE_NODE, f"model.hf_path={hf}", f"rollout.weight_transport={transport}")
        assert got.bucket_mb << 20 == sync_bucket_bytes("auto", transport)
        assert got.stages[0].buffers == 1  # 4.7 MB in one buffer either way


def test_the_70b_recipe_sends_stage_0_over_nvlink_and_the_others_over_infiniband(monkeypatch):
    """launch/slurm_llama70b.sbatch (any config: its layout is the script's): TP=4 x PP=5 over nodes
    0-2, one TP=4 replica on node 0."""
    monkeypatch.setenv("MEGATRON_ASYNC_ROLLOUT_TOKEN", "x")
    got = plan(*recipe_layout("slurm_llama70b.sbatch"), f"model.hf_path={FIXTURES / 'llama-3.1-70b'}",
               "placement.nnodes=3", "placement.gpus_per_node=8", "rollout.host=10.0.0.1",
               config=str(ROOT / "configs" / "gpu_llama8b_norobots.yaml"))
    assert [(s.sender_rank, s.sender_node) for s in got.stages] == [(0, 0), (4, 1), (8, 1), (12, 2), (16, 2)]
    assert [[g.link for g in s.groups] for s in got.stages] == [["nvlink"]] + [["infiniband"]] * 4
    assert [g.ranks for s in got.stages for g in s.groups] == [5] * 5  # one TP=4 replica: a group per stage
    assert [s.buffers for s in got.stages] == [24] * 5  # 27.4-29.5 GB in 1 GiB buffers
    assert [list(s.layers)[::15] for s in got.stages] == [[0, 15], [16, 31], [32, 47], [48, 63], [64, 79]]
    assert got.calls_per_replica == 5 + len(PHASE_CALLS)


def test_json_has_bytes_calls_and_seconds_per_stage_and_in_total(tmp_path, capsys):
    hf = tiny_dir(tmp_path / "m")
    assert cli.main(["plan-sync", RHO1B, "--json", *ONE_NODE, f"model.hf_path={hf}", "parallel.pp=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [sorted({"bytes", "calls_per_replica", "seconds"} & set(s)) for s in out["stages"]] == \
        [["bytes", "calls_per_replica", "seconds"]] * 2
    assert set(out["total"]) == {"bytes", "calls_per_replica", "seconds"}
    assert out["total"]["bytes"] == sum(s["bytes"] for s in out["stages"])
    assert out["total"]["seconds"] == pytest.approx(sum(s["seconds"] for s in out["stages"])
                                                    + len(PHASE_CALLS) * out["links"]["call_overhead_s"])


@pytest.mark.parametrize("overrides, names", [
    (["parallel.tp=3", "placement.learner_gpus=[0,1,2]"], "key 'parallel.tp' = 3"),  # 3 does not divide the 4 heads
    (["placement.gpus_per_node=0"], "placement.gpus_per_node"),
    (["model.hf_path=/nonexistent"], "model.hf_path"),
    (["rollout.num_replicas=9"], "rollout.num_replicas"),  # 9 replicas do not fit 8 GPUs
    (["--ib-gbps", "0"], "--ib-gbps"),
    (["placement.nnodes=2", "parallel.pp=2"], "key 'rollout.host'"),  # stage 1's sender on node 1, replicas on loopback
])
def test_a_bad_config_is_refused_with_one_line(tmp_path, capsys, overrides, names):
    hf = tiny_dir(tmp_path / "m")
    assert cli.main(["plan-sync", RHO1B, *ONE_NODE, f"model.hf_path={hf}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err
