"""The learner's GPU performance settings (`learner.perf`, `parallel.*` keys), checked on CPU.

The rules are pure functions of the backend (CUDA, TE spec, kernels) and the layout, so the GPU
decisions are tested here with a stated backend; the GPU configuration the lent H200 will run
(CUDA, no TE) is also built into a real GPTModel on CPU. CPU behaviour must not change: every
setting resolves off there.
"""
from __future__ import annotations

import json

import pytest

from megatron_async.config import ConfigError, load_config
from megatron_async.run_plan import build_plan, model_dtype
from megatron_async.learner.perf import Backend, PerfSettings, resolve
from tests.dist import run_worker

CPU = Backend(cuda=False, te=False)
GPU_LOCAL = Backend(cuda=True, te=False)  # CUDA, bare megatron-core (the lent H200's setup)
GPU_TE = Backend(cuda=True, te=True)
GPU_TE_APEX = Backend(cuda=True, te=True, grad_accum_kernel=True, softmax_kernel=True)
FLAGS = ("sequence_parallel", "overlap_grad_reduce", "overlap_param_gather", "gradient_accumulation_fusion",
         "rope_fusion", "distributed_optimizer", "masked_softmax_fusion")


def flags(perf) -> dict:
    return {k: getattr(perf, k) for k in FLAGS}


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_cpu_resolves_everything_off(tp, dp):
    assert not any(flags(resolve(None, CPU, tp=tp, dp=dp)).values())


def test_gpu_auto_defaults():
    local = flags(resolve(None, GPU_LOCAL, tp=2, dp=2))
    assert local == {"sequence_parallel": False, "overlap_grad_reduce": True, "overlap_param_gather": True,
                     "gradient_accumulation_fusion": False, "rope_fusion": False, "distributed_optimizer": True,
                     "masked_softmax_fusion": False}  # no kernel for it with the local spec
    te = flags(resolve(None, GPU_TE, tp=2, dp=2))
    assert te == {**local, "sequence_parallel": True, "rope_fusion": True, "masked_softmax_fusion": True}
    # one GPU, TP=1: nothing to overlap and no sequence to split
    single = flags(resolve(None, GPU_TE, tp=1, dp=1))
    assert not single["sequence_parallel"] and not single["overlap_grad_reduce"] and not single["overlap_param_gather"]
    # gradient-accumulation fusion: only with apex's kernel, and not with tied embeddings
    assert resolve(None, GPU_TE_APEX, tp=1, dp=1).gradient_accumulation_fusion
    assert not resolve(None, GPU_TE_APEX, tp=1, dp=1, tied_embeddings=True).gradient_accumulation_fusion
    # forced off wins over auto
    off = PerfSettings(sequence_parallel=False, overlap_grad_reduce=False, overlap_param_gather=False, rope_fusion=False)
    assert not any(flags(resolve(off, GPU_TE, tp=2, dp=2))[k] for k in
                   ("sequence_parallel", "overlap_grad_reduce", "overlap_param_gather", "rope_fusion"))


@pytest.mark.parametrize("key,backend,tp,dp", [
    ("sequence_parallel", CPU, 2, 1),  # megatron-core's torch-norm fallback refuses it
    ("sequence_parallel", GPU_LOCAL, 2, 1),  # ... on GPU too, without TE
    ("sequence_parallel", GPU_TE, 1, 1),  # nothing to split
    ("overlap_param_gather", CPU, 1, 2),  # no DistributedOptimizer on CPU
    ("gradient_accumulation_fusion", GPU_TE, 1, 1),  # apex kernel missing
    ("gradient_accumulation_fusion", GPU_LOCAL, 1, 1),
    ("rope_fusion", GPU_LOCAL, 1, 1),
])
def test_forcing_on_where_it_cannot_work_names_the_key(key, backend, tp, dp):
    with pytest.raises(ConfigError, match=f"parallel.{key}"):
        resolve(PerfSettings(**{key: True}), backend, tp=tp, dp=dp)


def test_overlap_param_gather_needs_overlap_grad_reduce_on_gpu():
    with pytest.raises(ConfigError, match="parallel.overlap_param_gather"):
        resolve(PerfSettings(overlap_grad_reduce=False, overlap_param_gather=True), GPU_TE, tp=1, dp=2)


def test_config_keys_and_static_validation():
    cfg = load_config(None, [])
    assert PerfSettings.from_config(cfg.parallel) == PerfSettings()  # all null = auto
    forced = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.overlap_grad_reduce=false"])
    assert PerfSettings.from_config(forced.parallel) == PerfSettings(sequence_parallel=True, overlap_grad_reduce=False)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config(None, ["parallel.sequence_parallel=true"])  # tp = 1
    with pytest.raises(ConfigError, match="parallel.overlap_param_gather"):
        load_config(None, ["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=false"])


def test_auto_replica_dtype_is_bf16_on_gpu_and_amx_cpus_fp32_elsewhere_and_for_the_tiny_model(monkeypatch):
    import torch

    from megatron_async import run_plan

    assert load_config(None, []).model.dtype == "auto"
    assert model_dtype(load_config(None, ["model.dtype=bfloat16"]).model) == ("bfloat16", "model.dtype")
    checkpoint = load_config(None, ["model.hf_path=runs/smollm2"]).model
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for flags, want in (({"avx2"}, "float32"), ({"avx2", "avx512_bf16"}, "float32"),
                        ({"avx512_bf16", "amx_bf16"}, "bfloat16")):
        monkeypatch.setattr(run_plan, "cpu_flags", lambda flags=flags: flags)
        assert model_dtype(checkpoint)[0] == want, flags
        assert model_dtype(load_config(None, []).model)[0] == "float32", flags  # the tiny model
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert model_dtype(checkpoint) == ("bfloat16", "auto: a CUDA device")


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_auto_dtype_on_a_faked_cpu_reaches_the_learner_the_replicas_and_the_sync_alike(amx, monkeypatch, tmp_path):
    """What `model.dtype: auto` decides downstream, with the CPU's flags faked (CI has no AMX; a user's
    Xeon does), so that a pick that differs by CPU shows on every machine: the learner's dtype, the
    replicas' vLLM `--dtype`, the dtype the weights are sent in, and the delta schedule that follows
    from it over http (deltas pay for 2-byte replicas only)."""
    import torch

    from megatron_async import run_plan
    from megatron_async.rollout.build import replica_spec
    from megatron_async.run_plan import AUTO_FULL_EVERY, resolve_full_every

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(run_plan, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", *(["amx_bf16"] if amx else [])})
    cfg = load_config(None, [f"model.hf_path={tmp_path}"])  # a checkpoint of the user's, not the built-in tiny model
    want = "bfloat16" if amx else "float32"
    assert model_dtype(cfg.model) == (want, "auto: this CPU has amx_bf16" if amx else "auto: a CPU without amx_bf16")
    assert replica_spec(cfg, build_plan(cfg), tmp_path).dtype == want
    full_every, _ = resolve_full_every("auto", "http", ["http://10.0.0.2:8000"], getattr(torch, want))
    assert full_every == (AUTO_FULL_EVERY if amx else 0)
    for stated in ("float32", "bfloat16"):  # a stated precision is the same on every CPU
        fixed = load_config(None, [f"model.hf_path={tmp_path}", f"model.dtype={stated}"])
        assert model_dtype(fixed.model)[0] == replica_spec(fixed, build_plan(fixed), tmp_path).dtype == stated


def test_cpu_transformer_config_is_unchanged(tiny_ckpts):
    """The flags the CPU learner ran with before the perf keys existed."""
    from megatron_async.learner.model import read_arch, transformer_config

    cfg = transformer_config(read_arch(tiny_ckpts["gqa"]), tp=2)
    assert {k: getattr(cfg, k) for k in ("sequence_parallel", "masked_softmax_fusion", "persist_layer_norm",
                                         "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                                         "gradient_accumulation_fusion", "bf16", "use_cpu_initialization")} == {
        "sequence_parallel": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
        "bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False, "bf16": False, "use_cpu_initialization": True}


def test_pipeline_stages_exchange_shapes_only_when_microbatch_shapes_vary(tiny_ckpts):
    """variable_seq_lengths (a shape message and a device sync per pipeline send) only under PP with
    a token budget (trainer.micro_batch_tokens: microbatches of one pass differ); by rows every
    microbatch of a pass has its shape, which the schedule's seq_length gives."""
    from megatron_async.learner.model import read_arch, transformer_config

    arch = read_arch(tiny_ckpts["gqa"])
    assert transformer_config(arch, pp=2, shapes_vary=True).variable_seq_lengths
    assert not transformer_config(arch, pp=2, shapes_vary=False).variable_seq_lengths
    assert not transformer_config(arch, pp=1, shapes_vary=True).variable_seq_lengths


@pytest.fixture(scope="module")
def worker(tiny_ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("perf") / "out.json"
    run_worker("perf_worker.py", out, tiny_ckpts["gqa"])
    return json.loads(out.read_text())


@pytest.mark.integration  # a megatron worker process
def test_gpu_local_spec_config_builds_a_model(worker):
    r = worker["gpu_local_spec"]
    assert r["params"] > 0
    assert r["flags"]["persist_layer_norm"] is False and r["flags"]["masked_softmax_fusion"] is False
    assert r["flags"]["bias_activation_fusion"] is True and r["flags"]["bf16"] is True
    # the flags used before (persist_layer_norm on CUDA) could not build the local spec's RMSNorm
    assert "persist_layer_norm" in r["old_flags_error"]


@pytest.mark.integration  # a megatron worker process
def test_sequence_padding_changes_nothing(worker):
    r = worker["padding"]
    assert r["shapes"] == [[2, 12], [2, 12]]  # padded to 15 inside, cut back before the loss
    assert r["logprob_diff"] < 1e-5
    assert r["value_scale"] > 0.1 and r["value_diff"] < 1e-5
    assert r["loss_padded"] == pytest.approx(r["loss"], abs=1e-5)


@pytest.mark.integration  # a megatron worker process
def test_overlapped_grad_reduce_matches_plain_at_dp2(tiny_ckpts, tmp_path):
    """The GPU default for DP > 1 (overlap_grad_reduce, megatron's async bucketed reduce) wired as the
    trainer uses it (no_sync + finalize_model_grads) gives the same steps; it also runs over gloo."""
    out = tmp_path / "overlap.json"
    run_worker("perf_worker.py", out, tiny_ckpts["gqa"], "--overlap", nproc=2)
    r = json.loads(out.read_text())
    off, on = r["overlap_False"], r["overlap_True"]
    assert (off["ddp_overlap"], on["ddp_overlap"]) == (False, True)
    assert on["grad_norms"] == pytest.approx(off["grad_norms"], rel=1e-6)
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    assert r["weight_diff"] < 1e-6
