"""The learner's GPU performance settings: which megatron-core features are on, and why.

    perf = PerfSettings.from_config(cfg.parallel)        # None = auto for each key
    model = build_model(hf_dir, perf=perf, backend=plan.backend)   # resolved once, kept in the LearnerModel record
    ddp, optimizer, scheduler = build_optimizer(model, settings)    # reads the record's settings

Each key is tri-state: True (on; an error naming the key if it cannot work here), False (off),
None (auto: on where megatron-core 0.16.1 supports it with our model, off otherwise, and always
off on CPU, so the CPU learner is exactly what it was before these keys existed).

| key                           | auto = on when                      | needs                              |
|-------------------------------|-------------------------------------|------------------------------------|
| sequence_parallel             | CUDA, TE spec, TP > 1               | TP > 1 and the TE spec (the local  |
|                               |                                     | spec's torch RMSNorm asserts it    |
|                               |                                     | is off)                            |
| overlap_grad_reduce           | CUDA, DP > 1                        | megatron DDP (always ours); works  |
|                               |                                     | over gloo too, so it may be forced |
|                               |                                     | on on CPU                          |
| overlap_param_gather          | CUDA, DP > 1, overlap_grad_reduce   | the DistributedOptimizer (GPU) and |
|                               |                                     | overlap_grad_reduce                |
| gradient_accumulation_fusion  | CUDA, TE spec, the apex kernel      | `fused_weight_gradient_mlp_cuda`:  |
|                               | `fused_weight_gradient_mlp_cuda`,   | GPTModel's output layer is         |
|                               | untied embeddings                   | megatron's own ColumnParallelLinear|
|                               |                                     | even with the TE spec, and raises  |
|                               |                                     | without that kernel                |
| rope_fusion                   | CUDA, TE spec                       | TE's fused RoPE kernel             |

Not keys (fixed by the backend): bias-activation and bias-dropout fusion (torch.compile'd
megatron code) on CUDA; masked-softmax fusion only where its kernel exists (the TE spec, whose
attention does not use it, or the legacy `scaled_masked_softmax_cuda` extension), never with the
local spec on bare megatron-core (it would import that missing extension in bf16);
persist_layer_norm never (only apex's FusedLayerNorm reads it, and the local spec's torch RMSNorm
asserts it is off).

Sequence parallel splits the sequence over TP ranks, so `learner.schedule` pads each microbatch's
sequence to a multiple of TP (extra positions are cut before the loss). overlap_param_gather
defers the parameter all-gather after an optimizer step to the next forward; `train_step` forces
it before returning (weights are read right after a step: weight sync, checkpoints, export)
unless the caller passes `sync_params=False` (for a step that another step follows directly).
Gradient-accumulation fusion stays off with tied embeddings: megatron marks the shared weight's
gradient as already accumulated when the output layer's fused wgrad GEMM writes it, and its DDP
hook then skips the lookup's gradient; not verified on a GPU, so auto leaves it off there.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_async.config import ConfigError

KEYS = ("sequence_parallel", "overlap_grad_reduce", "overlap_param_gather", "gradient_accumulation_fusion",
        "rope_fusion")


@dataclass(frozen=True)
class PerfSettings:
    """The requested settings (`parallel.<key>` in the config); None = auto."""

    sequence_parallel: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    rope_fusion: bool | None = None

    @classmethod
    def from_config(cls, parallel) -> "PerfSettings":
        """From `config.ParallelConfig` (or anything with these attributes; missing = auto)."""
        return cls(**{k: getattr(parallel, k, None) for k in KEYS})


@dataclass(frozen=True)
class Backend:
    """What the learner's machine has: CUDA, the Transformer Engine layer spec, legacy fused kernels
    (probed once, by the run plan: `run_plan.learner_backend`, `RunPlan.backend`)."""

    cuda: bool
    te: bool  # the TE layer spec is used (TE importable and CUDA)
    grad_accum_kernel: bool = False  # apex's fused_weight_gradient_mlp_cuda
    softmax_kernel: bool = False  # legacy scaled_masked_softmax_cuda + scaled_upper_triang_...


@dataclass(frozen=True)
class ResolvedPerf:
    """The settings the learner runs with (all booleans), and the backend they were resolved for."""

    sequence_parallel: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    gradient_accumulation_fusion: bool
    rope_fusion: bool
    distributed_optimizer: bool
    masked_softmax_fusion: bool
    backend: Backend

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "backend"}
        out["backend"] = {f.name: getattr(self.backend, f.name) for f in fields(self.backend)}
        return out


def _fail(key: str, value, why: str):
    raise ConfigError(f"key 'parallel.{key}' = {value!r}: {why}")


def resolve(perf: PerfSettings | None, backend: Backend, tp: int, dp: int, tied_embeddings: bool = False) -> ResolvedPerf:
    """Turn requested settings into the ones used. Raises ConfigError naming `parallel.<key>` when a
    setting forced on cannot work with this backend and layout."""
    perf = perf or PerfSettings()
    gpu = backend.cuda

    def pick(key: str, auto: bool, ok: bool, why: str) -> bool:
        value = getattr(perf, key)
        if value is None:
            return auto and ok
        if value and not ok:
            _fail(key, value, why)
        return bool(value)

    where = "CUDA" if gpu else "no CUDA (CPU learner)"
    sp = pick("sequence_parallel", True, gpu and backend.te and tp > 1,
              f"needs tensor parallelism (parallel.tp={tp}) and the Transformer Engine layer spec on CUDA "
              f"(here: {where}, TE spec {'on' if backend.te else 'off'}); megatron's torch RMSNorm of the local "
              f"spec refuses sequence parallelism")
    # megatron's bucketed async reduce works over gloo too (measured: same grads at DP=2 on CPU),
    # so forcing it on CPU is allowed (tests use it); auto keeps the CPU learner as it was
    ogr = pick("overlap_grad_reduce", gpu and dp > 1, True, "")
    opg = pick("overlap_param_gather", gpu and dp > 1 and ogr, gpu and ogr,
               "needs the DistributedOptimizer (used on CUDA only; here: "
               f"{where}) and parallel.overlap_grad_reduce on (resolved: {ogr})")
    gaf = pick("gradient_accumulation_fusion", not tied_embeddings, gpu and backend.te and backend.grad_accum_kernel,
               "needs CUDA, the Transformer Engine layer spec and apex's fused_weight_gradient_mlp_cuda "
               "extension (GPTModel's output layer is megatron's own ColumnParallelLinear, which raises "
               f"without it); here: {where}, TE spec {'on' if backend.te else 'off'}, extension "
               f"{'present' if backend.grad_accum_kernel else 'missing'}")
    rope = pick("rope_fusion", True, gpu and backend.te,
                f"needs Transformer Engine's fused RoPE kernel (TE spec on CUDA); here: {where}, "
                f"TE spec {'on' if backend.te else 'off'}")
    return ResolvedPerf(sequence_parallel=sp, overlap_grad_reduce=ogr, overlap_param_gather=opg,
                        gradient_accumulation_fusion=gaf, rope_fusion=rope, distributed_optimizer=gpu,
                        masked_softmax_fusion=gpu and (backend.te or backend.softmax_kernel), backend=backend)
