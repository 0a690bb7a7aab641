"""Typed run configuration: the schema and the checks of the config alone.

    cfg = load_config("configs/cpu_tiny.yaml", ["trainer.lr=1e-6", "rollout.max_lag=0"])
    megatron-async config --explain trainer.lr       # every key's type, default and help

Every key is a field of a dataclass below, declared with `opt(default, help)`; a help says what
the key is, docs/configuration.md and the page it points to say more. Loading checks the config
on its own, once: unknown keys, keys given twice and wrong types (config_io.py, which reads the
files), values out of range and settings that cannot work together (TP must divide the tiny
model's heads, lag >= 0, K as the algorithm needs, ...). What needs the world (files, models,
data, CPUs, GPUs) is checked by `run.preflight`. Each failure is one `ConfigError` naming the
key, the value and where it came from. What `auto` means on a machine is the run plan's.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from megatron_async.algorithms import ALGORITHMS
from megatron_async.config_io import ConfigError, apply_file, apply_overrides
from megatron_async.transports import LOOPBACK_HOSTS, TRANSPORTS, WeightTransport

TOKEN_ENV = "MEGATRON_ASYNC_ROLLOUT_TOKEN"  # rollout.token when the config leaves it empty


OnLongPrompt = Literal["error", "drop"]  # data.on_long_prompt, the one allowed-value set used beyond the schema
if TYPE_CHECKING:  # the registry's names are known when it is imported, not to a type checker
    AlgorithmName = str
else:
    AlgorithmName = Literal[tuple(ALGORITHMS)]  # trainer.algorithm: the registry's names (checked on load)


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """One config key: its default and the help text that `megatron-async config --explain` prints."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    name: str = opt("run", "run name; outputs go to <out_dir>/<name>")
    out_dir: str = opt("runs", "parent folder of run directories")
    seed: int = opt(1234, "seeds data order, sampling and initialisation")
    resume: bool = opt(False, "continue from <run dir>/checkpoints/latest (or run.resume_from)")
    resume_from: str = opt("",
        "with run.resume: the checkpoint to continue from instead of the latest: a folder under "
        "<run dir>/checkpoints (step_000010) or a path; later checkpoints go at its first save (docs/checkpoints.md)")
    stop_deadline_s: float = opt(240.0,
        "seconds after SIGTERM/SIGUSR1 to save at a step boundary and exit 75 before stopping at once; the "
        "launchers' torchrun and SLURM timeouts follow it (docs/reliability.md, `megatron-async stop-plan`)")


@dataclass
class ModelConfig:
    hf_path: str = opt("tiny", "HF checkpoint dir (config.json, safetensors, tokenizer) or \"tiny\" (built in code)")
    tiny_hidden_size: int = opt(128, "tiny model only")
    tiny_layers: int = opt(4, "tiny model only")
    tiny_heads: int = opt(4, "tiny model only")
    tiny_kv_heads: int = opt(2, "tiny model only")
    dtype: Literal["auto", "float32", "bfloat16"] = opt("auto",
        "the learner's and replicas' dtype (bfloat16: fp32 main weights and Adam state); auto: the run plan's, "
        "bfloat16 on GPU and AMX CPUs, else and for the tiny model float32 (docs/real-models.md)")
    make_vocab_size_divisible_by: int = opt(128,
        "the learner pads its vocabulary to a multiple of this x parallel.tp (megatron's default); 1 = of tp "
        "only; the padding never leaves the learner (docs/real-models.md)")


@dataclass
class ParallelConfig:
    tp: int = opt(1, "learner tensor-parallel size")
    pp: int = opt(1, "learner pipeline-parallel size")
    world_size: int = opt(0, "learner ranks; 0 = WORLD_SIZE from torchrun. DP = world / (tp * pp)")
    learner_cpus: int | str = opt("auto",
        "CPU ids the learner ranks pin to (\"0\", \"0-3\", \"0,2\"); \"\" = no pinning; auto: the run plan's "
        "split with the replicas on CPU machines, unpinned on GPU (docs/performance.md#cpu-placement)")
    # GPU performance settings (learner/perf.py): null = auto, on where megatron-core supports it with
    # our model, always off on CPU; true where it cannot work is an error naming the key.
    sequence_parallel: bool | None = opt(None,
        "split activations along the sequence over TP ranks; null = on for CUDA, tp > 1 and the TE spec")
    overlap_grad_reduce: bool | None = opt(None,
        "overlap the DP gradient reduce with the backward pass (megatron DDP buckets); null = on for CUDA with DP > 1")
    overlap_param_gather: bool | None = opt(None,
        "overlap the DistributedOptimizer's parameter all-gather with the next forward (needs "
        "overlap_grad_reduce, CUDA); null = on for CUDA with DP > 1")
    gradient_accumulation_fusion: bool | None = opt(None,
        "fuse weight-gradient accumulation into the GEMMs (TE spec + apex); null = on where both exist and "
        "embeddings are untied")
    rope_fusion: bool | None = opt(None, "Transformer Engine's fused RoPE kernel; null = on with the TE spec")


@dataclass
class DataConfig:
    train: str = opt("synthetic", "\"synthetic\" (GSM8k-style arithmetic), a .jsonl/.parquet path or a datasets name")
    eval: str = opt("synthetic", "held-out problems, same forms as `train`")
    eval_size: int = opt(64, "held-out prompts evaluated, for pass@1 or the RM score (0 = all)")
    question_key: str = opt("question", "record field of the prompt text (file / `datasets` sources)")
    answer_key: str | None = opt("answer",
        "record field of the reference answer (ends in a number); null = prompts only (reward_model, no SFT)")
    prompt_template: str = opt("Question: {question}\nAnswer:", "{question} is filled in (other braces doubled)")
    chat_template: bool = opt(False,
        "format each prompt with the tokenizer's chat template and generation prompt (instruct models; "
        "docs/real-models.md)")
    system_prompt: str = opt("", "chat_template only: a system turn before the question (\"\" = none: the "
                             "template's own default, if it has one)")
    max_prompt_tokens: int = opt(256, "longer prompts are an error (or dropped, see on_long_prompt)")
    on_long_prompt: OnLongPrompt = opt("error", "over max_prompt_tokens: stop the run (error) or drop, counted (drop)")


@dataclass
class RolloutConfig:
    num_replicas: int = opt(1, "vLLM engines (each its own process)")
    replica_tp: int = opt(1, "vLLM tensor parallel size per replica (GPU)")
    prompts_per_step: int = opt(16, "prompts generated per learner step (the paper's batch)")
    k: int = opt(4, "completions per prompt (K); DPO trains best vs worst")
    max_k: int = opt(16, "trainer.auto_balance: the highest K it may choose")
    max_lag: int | Literal["auto"] = opt(1,
        "bound on policy staleness in learner steps; 0 = synchronous baseline; auto = adapted to the measured "
        "KL within [1, lag_cap] (run/adaptive_lag.py)")
    lag_kl_target: float = opt(0.01, "max_lag auto: target of staleness/kl_k3_mean (per-token KL, generator vs learner)")
    lag_cap: int = opt(4, "max_lag auto: the highest lag it may choose")
    temperature: float = opt(0.7, "sampling temperature of training rollouts (evaluation is greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass of training rollouts")
    max_new_tokens: int = opt(64, "completion length cap (tokens)")
    stop: list = opt(factory=list, help="stop strings")
    kv_cache_gib: float = opt(1.0, "vLLM KV cache per replica (required on CPU)")
    host: str = opt("127.0.0.1", "replica servers listen here (a dedicated replica node: its address)")
    replica_urls: list = opt(factory=list, help=
        "URLs of vLLM servers started elsewhere (`megatron-async serve-replica`), used instead of num_replicas")
    weight_update: Literal["between_batches", "during_generation"] = opt("between_batches",
        "when replicas take new weights: between_batches (running requests finish first) or during_generation "
        "(PipelineRL's; docs/replicas-and-weight-sync.md)")
    base_port: int = opt(0, "first replica port (replica i binds base_port + i); 0 = each binds a free port")
    token: str = opt("",
        "auth token; required if host is not loopback; empty = $MEGATRON_ASYNC_ROLLOUT_TOKEN, else generated")
    max_replica_failures: int = opt(3, "restarts (or, for replica_urls, losses) per replica before the run stops")
    sync_bucket_mb: int | Literal["auto"] = opt("auto",
        "weight sync buffer cap (MiB): a bucket per call (shm/http), or a stage's packed buffer (nccl/gloo); "
        "auto = 64 for shm/http, 1024 for nccl/gloo")
    sync_timeout_s: float = opt(120.0, "a weight sync slower than this fails loudly")
    sync_full_every: int | Literal["auto"] = opt("auto",
        "0 = every sync full; N >= 2 = delta syncs, a full one every N (not nccl); auto = the run plan's: 10 "
        "for http with bf16 replicas, else 0 (docs/replicas-and-weight-sync.md)")
    weight_transport: WeightTransport = opt("auto",
        "how weights reach the replicas: shm, http, nccl or gloo; auto = the run plan's: nccl for this run's GPU "
        "replicas, else shm or http per replica (transports.py, docs/replicas-and-weight-sync.md)")
    rendezvous_address: str = opt("",
        "nccl/gloo: the address replicas reach the learner's sender at; \"\" = 127.0.0.1 for replicas on "
        "this host, else this host's address toward theirs")
    rendezvous_port: int = opt(0, "nccl/gloo: stage s, replica i use rendezvous_port + s * num_replicas + i; 0 = free")
    generate_timeout_s: float = opt(600.0, "a generation request slower than this fails its replica")
    startup_timeout_s: float = opt(300.0,
        "seconds a replica may take to answer after a (re)start or failure before the run stops; large GPU "
        "replicas starting together may need more (docs/reliability.md)")
    replica_cpus: int | str = opt("auto",
        "CPU ids every replica process pins to (\"1\", \"2-3\"); \"\" = no pinning; auto: the CPUs "
        "parallel.learner_cpus leaves (docs/performance.md#cpu-placement)")


@dataclass
class TrainerConfig:
    algorithm: AlgorithmName = opt("online_dpo", "the RL algorithm: algorithms/ (docs/algorithms.md)")
    steps: int = opt(20, "learner steps (one generation batch each)")
    lr: float = opt(5e-5, "peak learning rate of the policy (Adam)")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    warmup_steps: int = opt(2, "linear warm-up, in optimizer steps")
    lr_decay: Literal["constant", "linear", "cosine"] = opt("linear", "lr to min_lr over the optimizer steps")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 = none)")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.95, "Adam beta2")
    minibatches: int = opt(1, "N: minibatches (optimizer steps) per generation batch")
    updates_per_batch: int = opt(1, "T: passes over each batch")
    auto_balance: bool = opt(False,
        "raise T while generation-bound and rollout.k while training-bound, within their bounds (run/auto_balance.py)")
    max_updates_per_batch: int = opt(4, "auto_balance: the highest T it may choose")
    micro_batch_size: int = opt(8, "sequences per forward/backward microbatch (at most, with micro_batch_tokens)")
    micro_batch_tokens: int = opt(0,
        "0 = microbatches of micro_batch_size rows; N > 0 = a token budget: rows x longest row <= N per "
        "microbatch, each padded to its own longest row (docs/algorithms.md, docs/scaling.md)")
    logits_chunk_mb: int = opt(0,
        "0 = each microbatch's logits at once (fastest); N = at most N MB of fp32 logits per TP rank at a "
        "time, recomputed in the backward (learner/lm_head.py, docs/performance.md)")
    beta: float = opt(0.1, "DPO beta / KL coefficient")
    dpo_loss: Literal["sigmoid", "ipo"] = opt("sigmoid", "online_dpo: the DPO (sigmoid) or IPO loss")
    dpo_nll_coef: float = opt(0.0, "NLL weight on the chosen completion (RPO, Pang et al. 2024); 0 = plain DPO")
    clip_eps: float = opt(0.2, "PPO / GRPO / Proximal RLOO ratio clip")
    clip_eps_high: float | None = opt(None,
        "upper ratio clip of PPO and GRPO (DAPO's clip-higher, e.g. 0.28); null = clip_eps (symmetric)")
    off_policy_correction: Literal["auto", "none", "tis", "icepop", "decoupled"] = opt("auto",
        "ppo/rloo/proximal_rloo/grpo against the generator's logprobs: none, tis, icepop or decoupled; auto = "
        "tis when rollout.max_lag != 0, else none (docs/off-policy.md)")
    is_cap: float = opt(2.0, "tis: the importance weights' cap; decoupled: tokens whose weight exceeds it are dropped")
    icepop_low: float = opt(0.5, "icepop: lowest importance weight kept")
    icepop_high: float = opt(2.0, "icepop: highest importance weight kept")
    staleness_monitor: bool = opt(True,
        "log staleness/* (generator-vs-learner KL, importance weights) every step; costs a forward pass")
    grpo_std_normalization: bool = opt(True, "grpo: divide advantages by the group's reward std (false = Dr. GRPO)")
    loss_aggregation: Literal["token", "sequence"] = opt("token",
        "grpo: mean over all completion tokens (token: DAPO, Dr. GRPO) or per completion (sequence: GRPO's)")
    grpo_kl_coef: float = opt(0.0, "grpo: weight of the k3 KL to the reference in the loss (0 = KL only logged)")
    vf_coef: float = opt(0.1, "PPO value loss weight")
    value_lr: float | None = opt(None,
        "PPO value model learning rate (its own Adam; the policy's schedule, scaled); None = trainer.lr")
    gamma: float = opt(1.0, "PPO discount")
    lam: float = opt(0.95, "PPO GAE lambda")
    checkpoint_every: int = opt(10, "steps between checkpoints (0 = only at the end)")
    async_save: bool = opt(True, "save checkpoints in a background process, the learner going on (docs/checkpoints.md)")
    eval_every: int = opt(0, "steps between pass@1 evaluations (0 = before and after only)")
    max_bad_steps: int = opt(3, "consecutive bad steps (NaN/inf, no reward) before the run stops (run/bad_steps.py)")


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-up steps on the train split before RL (0 = none)")
    lr: float = opt(1e-3, "SFT peak learning rate (warm-up over min(20, steps // 10) steps, then cosine decay to lr / 10)")
    batch_size: int = opt(32, "SFT sequences per optimizer step")


@dataclass
class RewardConfig:
    kind: Literal["gsm8k_exact_match", "reward_model"] = opt("gsm8k_exact_match",
        "how a completion is scored: rewards.make_scorer (docs/rewards.md)")
    model_path: str = opt("", "HF sequence-classification checkpoint, num_labels=1 (kind=reward_model)")
    batch_size: int = opt(16, "kind=reward_model: texts per RM forward pass")
    max_length: int = opt(1024, "kind=reward_model: prompt + completion tokens kept (cut on the left)")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "kind=reward_model: RM weights")
    device: str = opt("cpu",
        "kind=reward_model: where the RM process runs, \"cpu\" or \"cuda:N\" (a CUDA index as learner rank 0,"
        " which starts it, sees it; not one of the replicas' GPUs: docs/rewards.md)")
    timeout_s: float = opt(30.0, "exact match: per sample; reward_model: per forward pass of batch_size texts")
    on_error: Literal["drop", "stop"] = opt("drop", "a failed sample is dropped (counted) or stops the run")


@dataclass
class PlacementConfig:
    """Where learner ranks and replicas run; see cluster/placement.py and docs/multi-node.md."""

    nnodes: int = opt(1, "nodes in the job (torchrun --nnodes); learner ranks run on every node")
    replica_node: int = opt(0, "node rank hosting the replicas; 0 unless placement.dedicated_replica_node")
    dedicated_replica_node: bool = opt(False, "the replica node runs only `serve-replica` (docs/multi-node.md)")
    gpus_per_node: int = opt(0, "GPUs per node; 0 = detect at launch. Ignored without CUDA.")
    learner_gpus: list | str = opt("auto",
        "CUDA ids of the learner ranks on each node; \"auto\" = the node's GPUs that are not replica GPUs")
    replica_gpus: list | str = opt("auto",
        "CUDA ids of the replicas on the replica node, replica_tp per replica; \"auto\" = the node's last ones")


@dataclass
class TrackingConfig:
    uri: str = opt("", "MLflow tracking URI; empty = embedded SQLite store at <run dir>/mlflow.db")
    experiment: str = opt("megatron_async", "MLflow experiment name")
    enabled: bool = opt(True, "log to MLflow (false: metrics only in history.json and the log)")
    flush_timeout_s: float = opt(5.0, "per attempt to deliver buffered metrics to the server")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


# ----------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides (config_io.py); then validate."""
    cfg = Config()
    if path is not None:
        apply_file(cfg, path)
    apply_overrides(cfg, overrides)
    if not cfg.rollout.token:
        cfg.rollout.token = os.environ.get(TOKEN_ENV, "")
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- validation


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"key '{key}' = {value!r}: {why}")


def validate(cfg: Config) -> None:
    """Check values that each type allows but that cannot run together. Raises ConfigError.

    The config alone: no file, model or machine is looked at (that is `run.preflight`)."""
    r, t, par = cfg.rollout, cfg.trainer, cfg.parallel
    for key, value in [("parallel.tp", par.tp), ("parallel.pp", par.pp), ("rollout.num_replicas", r.num_replicas),
                       ("rollout.replica_tp", r.replica_tp), ("rollout.prompts_per_step", r.prompts_per_step),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("trainer.minibatches", t.minibatches),
                       ("trainer.updates_per_batch", t.updates_per_batch), ("trainer.micro_batch_size", t.micro_batch_size),
                       ("rollout.k", r.k), ("data.max_prompt_tokens", cfg.data.max_prompt_tokens),
                       ("model.make_vocab_size_divisible_by", cfg.model.make_vocab_size_divisible_by),
                       ("trainer.max_bad_steps", t.max_bad_steps)]:
        _require(value >= 1, key, value, "must be >= 1")
    for key, value in [("trainer.steps", t.steps), ("sft.steps", cfg.sft.steps), ("trainer.warmup_steps", t.warmup_steps),
                       ("parallel.world_size", par.world_size), ("data.eval_size", cfg.data.eval_size),
                       ("trainer.micro_batch_tokens", t.micro_batch_tokens)]:
        _require(value >= 0, key, value, "must be >= 0")
    if r.max_lag == "auto":
        _require(t.staleness_monitor, "rollout.max_lag", r.max_lag,
                 "auto follows the staleness monitor's KL: needs trainer.staleness_monitor=true")
        _require(1 <= r.lag_cap <= 64, "rollout.lag_cap", r.lag_cap, "must be in [1, 64]")
        _require(r.lag_kl_target > 0, "rollout.lag_kl_target", r.lag_kl_target, "must be > 0")
    else:
        _require(r.max_lag >= 0, "rollout.max_lag", r.max_lag, "lag must be >= 0 (0 = synchronous)")
        _require(r.max_lag <= 64, "rollout.max_lag", r.max_lag, "lag above 64 steps is surely a mistake")
    _require(t.clip_eps_high is None or t.clip_eps_high > 0, "trainer.clip_eps_high", t.clip_eps_high, "must be > 0")
    _require(t.is_cap > 0, "trainer.is_cap", t.is_cap, "must be > 0")
    _require(0 <= t.icepop_low < t.icepop_high, "trainer.icepop_low", t.icepop_low,
             f"must be in [0, trainer.icepop_high = {t.icepop_high})")
    _require(t.grpo_kl_coef >= 0, "trainer.grpo_kl_coef", t.grpo_kl_coef, "must be >= 0")
    if t.auto_balance:
        _require(t.max_updates_per_batch >= t.updates_per_batch, "trainer.max_updates_per_batch",
                 t.max_updates_per_batch, f"must be >= trainer.updates_per_batch ({t.updates_per_batch})")
        _require(r.max_k >= r.k, "rollout.max_k", r.max_k, f"must be >= rollout.k ({r.k})")
    for ok, key, value, why in ALGORITHMS[t.algorithm].rules(cfg):
        _require(ok, key, value, why)
    _require(t.lr > 0, "trainer.lr", t.lr, "must be > 0")
    _require(cfg.run.stop_deadline_s > 0, "run.stop_deadline_s", cfg.run.stop_deadline_s, "must be > 0")
    _require(0 <= t.min_lr <= t.lr, "trainer.min_lr", t.min_lr, "must be in [0, trainer.lr]")
    _require(t.grad_clip >= 0, "trainer.grad_clip", t.grad_clip, "must be >= 0 (0 = no clipping)")
    _require(0 < r.temperature <= 10, "rollout.temperature", r.temperature, "sampling needs 0 < temperature <= 10")
    _require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _require(r.kv_cache_gib > 0, "rollout.kv_cache_gib", r.kv_cache_gib, "vLLM on CPU needs a KV cache size > 0")
    _require(r.sync_bucket_mb == "auto" or (isinstance(r.sync_bucket_mb, int) and r.sync_bucket_mb >= 1),
             "rollout.sync_bucket_mb", r.sync_bucket_mb, "must be auto or >= 1")
    _require(r.startup_timeout_s > 0, "rollout.startup_timeout_s", r.startup_timeout_s,
             "must be > 0 (seconds a replica may take to start)")
    _require(t.logits_chunk_mb >= 0, "trainer.logits_chunk_mb", t.logits_chunk_mb, "must be >= 0 (0 = whole logits)")
    _require(r.sync_full_every in ("auto", 0) or (isinstance(r.sync_full_every, int) and r.sync_full_every >= 2),
             "rollout.sync_full_every", r.sync_full_every,
             "must be auto, 0 (every sync full) or >= 2 (a full sync every N, deltas between)")
    _require(r.sync_full_every in ("auto", 0) or TRANSPORTS[r.weight_transport].delta, "rollout.sync_full_every",
             r.sync_full_every, "delta sync is built for the host-memory transports and gloo, not "
                                f"rollout.weight_transport={r.weight_transport}; on GPU, vLLM's sparse_nccl backend is the path "
                                "(docs/replicas-and-weight-sync.md)")
    _require(cfg.tracking.flush_timeout_s > 0, "tracking.flush_timeout_s", cfg.tracking.flush_timeout_s, "must be > 0")
    if TRANSPORTS[r.weight_transport].loopback_only:
        _require(r.host in LOOPBACK_HOSTS and not cfg.placement.dedicated_replica_node and not r.replica_urls,
                 "rollout.weight_transport", r.weight_transport,
                 f"shared memory needs the replicas on the learner's host (rollout.host={r.host!r}, "
                 f"placement.dedicated_replica_node={cfg.placement.dedicated_replica_node}): use auto or http")
    if r.rendezvous_port:  # used by nccl and gloo, also where auto picks nccl
        groups = r.num_replicas * cfg.parallel.pp  # one per (pipeline stage, replica): weights/broadcast.py
        _require(r.rendezvous_port == 0 or 1024 <= r.rendezvous_port <= 65535 - groups, "rollout.rendezvous_port",
                 r.rendezvous_port, f"must be 0 (free ports) or in [1024, {65535 - groups}] (stage s's group with "
                 f"replica i uses rendezvous_port + s * num_replicas + i: {groups} ports)")
    if r.replica_urls:
        _require(bool(r.token), "rollout.token", "", "rollout.replica_urls: servers started elsewhere need their key")
        _require(all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in r.replica_urls),
                 "rollout.replica_urls", r.replica_urls, "must be a list of http(s):// URLs")
    if cfg.placement.dedicated_replica_node and not r.replica_urls:
        _require(r.base_port != 0, "rollout.base_port", r.base_port,
                 "placement.dedicated_replica_node: replica i listens on rollout.base_port + i: set a port")
    _require(r.prompts_per_step % t.minibatches == 0, "trainer.minibatches", t.minibatches,
             f"must divide rollout.prompts_per_step ({r.prompts_per_step})")
    _require(r.base_port == 0 or 1024 <= r.base_port <= 65535 - r.num_replicas, "rollout.base_port", r.base_port,
             f"must be 0 (free ports) or in [1024, {65535 - r.num_replicas}] (replica i binds base_port + i)")
    if r.host not in LOOPBACK_HOSTS:
        _require(bool(r.token), "rollout.token", "", f"rollout.host={r.host!r} is not loopback: set a token")
    if cfg.reward.kind == "reward_model":
        _require(bool(cfg.reward.model_path), "reward.model_path", "", "reward.kind=reward_model needs a checkpoint")
        _require(cfg.reward.batch_size >= 1, "reward.batch_size", cfg.reward.batch_size, "must be >= 1")
        _require(cfg.reward.max_length >= 1, "reward.max_length", cfg.reward.max_length, "must be >= 1")
        _require(re.fullmatch(r"cpu|cuda:\d+", cfg.reward.device) is not None, "reward.device", cfg.reward.device,
                 'must be "cpu" or "cuda:N" (a CUDA device index)')
    if cfg.data.answer_key is None:  # prompts without a reference answer
        _require(cfg.reward.kind == "reward_model", "data.answer_key", None,
                 f"reward.kind={cfg.reward.kind} compares with the reference answer: name its field")
        _require(cfg.sft.steps == 0, "data.answer_key", None,
                 f"sft.steps={cfg.sft.steps} trains on the reference answer: name its field or set sft.steps=0")
    if cfg.model.hf_path == "tiny":  # a real checkpoint's heads are checked against its config.json in preflight
        heads, groups = cfg.model.tiny_heads, cfg.model.tiny_kv_heads
        _require(heads % groups == 0, "model.tiny_kv_heads", groups, f"must divide model.tiny_heads ({heads})")
        _require(heads % par.tp == 0, "parallel.tp", par.tp, f"must divide the number of attention heads ({heads})")
        _require(groups % par.tp == 0, "parallel.tp", par.tp,
                 f"must divide the number of query groups / KV heads ({groups})")
        _require(cfg.model.tiny_layers % par.pp == 0, "parallel.pp", par.pp,
                 f"must divide the number of layers (model.tiny_layers = {cfg.model.tiny_layers})")
    if par.world_size:
        _require(par.world_size % (par.tp * par.pp) == 0, "parallel.world_size", par.world_size,
                 f"must be a multiple of tp x pp = {par.tp} x {par.pp} = {par.tp * par.pp}")
    # the GPU performance keys that need no CUDA or TE to judge (the rest: learner/perf.py, at build)
    _require(par.sequence_parallel is not True or par.tp > 1, "parallel.sequence_parallel", par.sequence_parallel,
             f"sequence parallelism splits the sequence over TP ranks: needs parallel.tp > 1 (is {par.tp})")
    _require(par.overlap_param_gather is not True or par.overlap_grad_reduce is not False,
             "parallel.overlap_param_gather", par.overlap_param_gather,
             "needs parallel.overlap_grad_reduce (true or null), as megatron-core requires")
    _check_placement(cfg)


def _gpu_ids(p: PlacementConfig, key: str) -> list[int] | None:
    """placement.<key> as a list of CUDA ids, or None for "auto"; checks ints >= 0 without duplicates."""
    value = getattr(p, key)
    if value == "auto":
        return None
    _require(not isinstance(value, str), f"placement.{key}", value, 'expected a list of CUDA device ids or "auto"')
    _require(bool(value) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value),
             f"placement.{key}", value, "expected a non-empty list of CUDA device ids (ints >= 0)")
    _require(len(set(value)) == len(value), f"placement.{key}", value, "a device id is listed twice")
    return list(value)


def _check_placement(cfg: Config) -> None:
    """Where things run, as far as the config alone says: node numbers, id lists, explicit overlap
    (the GPU counts of the nodes: cluster/placement.py at launch)."""
    p, r = cfg.placement, cfg.rollout
    _require(p.nnodes >= 1, "placement.nnodes", p.nnodes, "must be >= 1")
    _require(0 <= p.replica_node < p.nnodes, "placement.replica_node", p.replica_node,
             f"must be a node rank in [0, {p.nnodes})")
    _require(p.replica_node == 0 or p.dedicated_replica_node, "placement.replica_node", p.replica_node,
             "must be 0 unless placement.dedicated_replica_node is true. Replicas on a learner node are subprocesses "
             "of global learner rank 0, which a static torchrun rendezvous puts on node 0; a node that only hosts "
             "replicas runs `megatron-async serve-replica`")
    if p.dedicated_replica_node:
        _require(p.nnodes >= 2, "placement.dedicated_replica_node", True,
                 f"needs placement.nnodes >= 2 (the replica node runs no learner ranks), got {p.nnodes}")
        _require(bool(r.token), "rollout.token", "", "a dedicated replica node needs the shared secret: learner rank "
                 "0 and `serve-replica` authenticate with it (set it or $MEGATRON_ASYNC_ROLLOUT_TOKEN)")
    _require(p.gpus_per_node >= 0, "placement.gpus_per_node", p.gpus_per_node, "must be >= 0 (0 = detect)")
    learner, replica = _gpu_ids(p, "learner_gpus"), _gpu_ids(p, "replica_gpus")
    need = r.num_replicas * r.replica_tp
    _require(replica is None or len(replica) >= need, "placement.replica_gpus", replica,
             f"{len(replica or [])} GPUs cannot hold rollout.num_replicas x rollout.replica_tp = "
             f"{r.num_replicas} x {r.replica_tp} = {need}")
    both = set(learner or []) & set(replica or [])
    _require(not both or p.dedicated_replica_node, "placement.learner_gpus", learner,
             f"overlaps placement.replica_gpus = {replica} (GPUs {sorted(both)}); the replica node needs them apart")
