"""Typed run configuration: the schema and the checks of the config alone.

    cfg = load_config("configs/cpu_tiny.yaml", ["trainer.lr=1e-6", "rollout.max_lag=0"])
    megatron-async config --explain trainer.lr       # every key's type, default and help

Every key is a field of a dataclass below, declared with `opt(default, help)`. Loading checks the
config on its own, once: unknown keys, keys given twice in a file and wrong types (config_io.py,
which reads the files), values out of range and settings that cannot work together (TP must divide the tiny model's heads and query
groups, lag >= 0, K as the algorithm needs, ...). What needs the world (files, model
architectures, data, CPUs, GPUs) is checked by `run.preflight` before anything starts. Each
failure is one `ConfigError` naming the key, the value and where it came from (file or command
line). What `auto` means on a machine is the run plan's (run_plan.py), not this module's.
"""
from __future__ import annotations

import dataclasses
import math
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


TORCHRUN_GRACE_S = 60  # torchrun's wait beyond run.stop_deadline_s: the ranks' exit after their save or stop at once


@dataclass(frozen=True)
class StopBudget:
    """run.stop_deadline_s and what the launchers derive from it, in whole seconds (`stop_budget`)."""
    deadline_s: int  # signal -> checkpoint saved and exit 75, or stop at once (run/stop.py)
    shutdown_timeout_s: int  # torchrun's --shutdown-timeout: how long it waits for its ranks before SIGKILL
    warning_lead_s: int  # the SLURM scripts' USR1 this long before the time limit: the whole stop fits before it


def stop_budget(run: "RunConfig") -> StopBudget:
    """The one place the stop's time budget is derived: torchrun waits the ranks' deadline plus
    TORCHRUN_GRACE_S, and the SLURM warning comes that long before the time limit, so that SLURM's
    own SIGTERM (and SIGKILL after KillWait) finds the job already saved and stopped."""
    deadline = math.ceil(run.stop_deadline_s)
    shutdown = deadline + TORCHRUN_GRACE_S
    return StopBudget(deadline_s=deadline, shutdown_timeout_s=shutdown, warning_lead_s=shutdown)


@dataclass
class RunConfig:
    name: str = opt("run", "run name; outputs go to <out_dir>/<name>")
    out_dir: str = opt("runs", "parent folder of run directories")
    seed: int = opt(1234, "seeds data order, sampling and initialisation")
    resume: bool = opt(False, "continue from <run dir>/checkpoints/latest (or run.resume_from)")
    resume_from: str = opt("",
        "with run.resume (--resume): the checkpoint to continue from instead of the latest, e.g. step_000010 "
        "(a folder under <run dir>/checkpoints) or a path; what the preflight names when the latest is "
        "corrupt (docs/checkpoints.md). Later checkpoints of the run are removed at its first save.")
    stop_deadline_s: float = opt(240.0,
        "after SIGTERM or SIGUSR1 the run finishes its learner step, saves a checkpoint there and exits 75 "
        "(requeue me); if that has not happened this many seconds after the signal (or a second signal comes) "
        "it stops at once, the previous checkpoint intact (run/stop.py). Size it to a learner step plus two "
        "checkpoint writes (docs/reliability.md). Every launcher derives torchrun's --shutdown-timeout and the "
        "SLURM scripts' warning before the time limit from it (config.stop_budget, `megatron-async stop-plan`).")


@dataclass
class ModelConfig:
    hf_path: str = opt("tiny",
        "HF checkpoint directory (config.json + safetensors + tokenizer), or \"tiny\" to build a tiny LLaMA "
        "and BPE tokenizer in code (the CPU default; see megatron_async/models/tiny.py).")
    tiny_hidden_size: int = opt(128, "tiny model only")
    tiny_layers: int = opt(4, "tiny model only")
    tiny_heads: int = opt(4, "tiny model only")
    tiny_kv_heads: int = opt(2, "tiny model only")
    dtype: Literal["auto", "float32", "bfloat16"] = opt("auto",
        "the learner's and the replicas' (vLLM) dtype; bfloat16 trains with fp32 main weights, grads and Adam "
        "state. auto (the run plan's, logged at launch): bfloat16 on GPU and on CPUs with AMX, else float32, "
        "and float32 for the built-in tiny model (run_plan.model_dtype)")
    make_vocab_size_divisible_by: int = opt(128,
        "the learner pads its vocabulary (embedding and output-layer rows) to a multiple of this x parallel.tp, "
        "as megatron-LM does (default 128, megatron's), so a vocab_size TP does not divide (32001, 1003) still "
        "splits evenly and each rank's slice is aligned; 1 = pad only to a multiple of tp. The padding rows are "
        "zero, their logits -inf in every logprob, and they are stripped from the HF export and the weight sync "
        "(vLLM and HF checkpoints keep the model's vocab_size). See learner/model.py and docs/real-models.md.")


@dataclass
class ParallelConfig:
    tp: int = opt(1, "learner tensor-parallel size")
    pp: int = opt(1, "learner pipeline-parallel size")
    world_size: int = opt(0,
        "world size (learner ranks); 0 = take WORLD_SIZE from torchrun. DP = world / (tp * pp).")
    learner_cpus: int | str = opt("auto",
        "CPU ids for the learner ranks (\"0\", \"0-3\", \"0,2\"; split evenly over local ranks when there are"
        " enough): sched_setaffinity + torch threads. \"\" = no pinning. auto (logged at launch): without CUDA"
        " and with the replicas on this node, the first max(local learner ranks, n // 2) of this machine's n CPUs"
        " (2 CPUs: \"0\"), the CPUs rollout.replica_cpus leaves if that is set; unpinned on GPU machines, with"
        " fewer CPUs than local ranks + 1, or without replicas here. The SFT phase uses every CPU either way."
        " See cluster/cpu_affinity.py.")
    # GPU performance settings (learner/perf.py): null = auto, on where megatron-core supports it with
    # our model, always off on CPU; true where it cannot work is an error naming the key.
    sequence_parallel: bool | None = opt(None,
        "split activations along the sequence over TP ranks; null = on for CUDA with tp > 1 and the Transformer "
        "Engine spec (the local spec's torch RMSNorm refuses it)")
    overlap_grad_reduce: bool | None = opt(None,
        "overlap the DP gradient reduce with the backward pass (megatron DDP buckets); null = on for CUDA with DP > 1")
    overlap_param_gather: bool | None = opt(None,
        "overlap the DistributedOptimizer's parameter all-gather with the next forward; needs overlap_grad_reduce "
        "(CUDA only); null = on for CUDA with DP > 1. The gather is completed at the end of a step whose weights "
        "are read next (weight sync, checkpoints)")
    gradient_accumulation_fusion: bool | None = opt(None,
        "fuse weight-gradient accumulation into the GEMMs; needs the TE spec and apex's fused_weight_gradient_mlp_cuda "
        "(GPTModel's output layer is megatron's own linear); null = on where both exist and embeddings are untied")
    rope_fusion: bool | None = opt(None, "Transformer Engine's fused RoPE kernel; null = on with the TE spec")


@dataclass
class DataConfig:
    train: str = opt("synthetic",
        "\"synthetic\" (procedural GSM8k-style arithmetic), a .jsonl/.parquet path, or a datasets name")
    eval: str = opt("synthetic", "held-out problems, same forms as `train`")
    eval_size: int = opt(64, "held-out prompts evaluated, for pass@1 or the RM score (0 = all)")
    question_key: str = opt("question",
        "record field of the prompt text in file / `datasets` sources (ignored for \"synthetic\"); No Robots:"
        " prompt")
    answer_key: str | None = opt("answer",
        "record field of the reference answer (must end in a number: exact match and SFT need it); null = "
        "prompts only (reward.kind=reward_model, sft.steps=0)")
    prompt_template: str = opt("Question: {question}\nAnswer:",
        "the prompt text; {question} is filled in (other braces doubled)")
    chat_template: bool = opt(False,
        "format each prompt as a chat with the tokenizer's own template and generation prompt (an instruct "
        "model): [system?, user: prompt_template filled] -> apply_chat_template(add_generation_prompt=True), "
        "tokenized without adding special tokens again; a reward model scores the chat with its own template. "
        "Set prompt_template to \"{question}\" for the bare question as the user turn")
    system_prompt: str = opt("", "chat_template only: a system turn before the question (\"\" = none: the "
                             "template's own default, if it has one)")
    max_prompt_tokens: int = opt(256, "longer prompts are an error (or dropped, see on_long_prompt)")
    on_long_prompt: OnLongPrompt = opt("error",
        "a prompt over max_prompt_tokens stops the run (error) or is dropped and counted (drop)")


@dataclass
class RolloutConfig:
    num_replicas: int = opt(1, "vLLM engines (each its own process)")
    replica_tp: int = opt(1, "vLLM tensor parallel size per replica (GPU)")
    prompts_per_step: int = opt(16, "prompts generated per learner step (the paper's batch)")
    k: int = opt(4, "completions per prompt (K); DPO trains best vs worst")
    max_k: int = opt(16, "trainer.auto_balance: the highest K it may choose")
    max_lag: int | Literal["auto"] = opt(1,
        "bound on policy staleness in learner steps; 0 = synchronous baseline; auto = adapted to the measured "
        "staleness (run/adaptive_lag.py: starts at 1, rises while KL < lag_kl_target and the learner waits "
        "for generation, falls when KL exceeds it)")
    lag_kl_target: float = opt(0.01, "max_lag auto: target of staleness/kl_k3_mean (per-token KL, generator vs learner)")
    lag_cap: int = opt(4, "max_lag auto: the highest lag it may choose")
    temperature: float = opt(0.7, "sampling temperature of training rollouts (evaluation is greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass of training rollouts")
    max_new_tokens: int = opt(64, "completion length cap (tokens)")
    stop: list = opt(factory=list, help="stop strings")
    kv_cache_gib: float = opt(1.0, "vLLM KV cache per replica (required on CPU)")
    host: str = opt("127.0.0.1",
        "replica servers listen here (placement.dedicated_replica_node: the replica node's address)")
    replica_urls: list = opt(factory=list, help=
        "URLs of vLLM servers started elsewhere (any launcher, e.g. an srun line running `megatron-async "
        "serve-replica`), used instead of starting num_replicas here; they need rollout.token")
    weight_update: Literal["between_batches", "during_generation"] = opt("between_batches",
        "when replicas take new weights: between_batches (the paper's: running requests finish first, no "
        "completion spans two versions) or during_generation (PipelineRL's: /pause?mode=keep freezes running "
        "requests, they continue under the new weights; a completion carries the versions it spans and the "
        "lag bound uses the oldest; prefix caching off)")
    base_port: int = opt(0,
        "first replica port (replica i binds base_port + i; fixed ports for firewalls between nodes); 0 = "
        "each replica binds a free port")
    token: str = opt("",
        "auth token; generated when empty; required if host is not loopback. When empty, read from "
        "$MEGATRON_ASYNC_ROLLOUT_TOKEN (launch scripts use it: a command line is visible in `ps`)")
    max_replica_failures: int = opt(3, "restarts (or, for replica_urls, losses) per replica before the run stops")
    sync_bucket_mb: int | Literal["auto"] = opt("auto",
        "weight sync buffer cap (MiB): shm/http bucket per /update_weights call; nccl/gloo packed buffer, "
        "double-buffered, all of a stage in one call. auto = 64 for shm/http, 1024 for nccl/gloo")
    sync_timeout_s: float = opt(120.0, "a weight sync slower than this fails loudly")
    sync_full_every: int | Literal["auto"] = opt("auto",
        "0 = every weight sync sends every weight; N >= 2 = delta sync: only the changed elements, a full sync "
        "every N syncs and after a replica failure (weights/delta.py; not over nccl). auto = 10 where a replica "
        "is reached over http and the replicas are bf16, else 0 (run_plan.resolve_full_every)")
    weight_transport: WeightTransport = opt("auto",
        "how weights reach the replicas (transports.py): shm (/dev/shm, replicas on this host) or http (any "
        "host) through host memory; nccl (GPU replicas) or gloo (CPU) through process groups. auto "
        "(run_plan.weight_transport): nccl for the GPU replicas this run starts, else shm or http per replica")
    rendezvous_address: str = opt("",
        "weight_transport=nccl/gloo: the address replicas reach the learner's sender at (its process "
        "group's TCP rendezvous); \"\" = 127.0.0.1 for replicas on this host, else the address this host "
        "uses to reach the replica's host")
    rendezvous_port: int = opt(0,
        "weight_transport=nccl/gloo: the group of learner pipeline stage s whose first replica is replica i (one "
        "group per replica host) rendezvous at rendezvous_port + s * num_replicas + i; 0 = a free port each time")
    generate_timeout_s: float = opt(600.0, "a generation request slower than this fails its replica")
    startup_timeout_s: float = opt(300.0,
        "seconds a replica may take to answer after it was started or restarted (a replica_urls server: to "
        "answer again after a failure) before the run stops. GPU replicas load their weights, compile and "
        "capture CUDA graphs before they answer; several large replicas starting at once on one node (four 8B) "
        "may need more")
    replica_cpus: int | str = opt("auto",
        "CPU ids every replica process pins itself to (\"1\", \"2-3\"); \"\" = no pinning (if the learner is "
        "pinned, replicas get the CPUs the learner had before pinning). auto: the CPUs the learner's share "
        "leaves (parallel.learner_cpus: 2 CPUs give the replicas \"1\"), unpinned where the learner is. See "
        "cluster/cpu_affinity.py.")


@dataclass
class TrainerConfig:
    algorithm: AlgorithmName = opt("online_dpo", "the RL algorithm: algorithms/ (docs/algorithms.md)")
    steps: int = opt(20, "learner steps (one generation batch each)")
    lr: float = opt(5e-5, "peak learning rate of the policy (Adam)")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    warmup_steps: int = opt(2, "linear warm-up, in optimizer steps")
    lr_decay: Literal["constant", "linear", "cosine"] = opt("linear",
        "decay from lr to min_lr over the run's optimizer steps")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 = none)")
    adam_beta1: float = opt(0.9, "Adam beta1")
    adam_beta2: float = opt(0.95, "Adam beta2")
    minibatches: int = opt(1, "N: minibatches (optimizer steps) per generation batch")
    updates_per_batch: int = opt(1, "T: passes over each batch")
    auto_balance: bool = opt(False,
        "raise T while generation-bound and rollout.k while training-bound, each within its bound "
        "(run/auto_balance.py: the paper's Section 4)")
    max_updates_per_batch: int = opt(4, "auto_balance: the highest T it may choose")
    micro_batch_size: int = opt(8, "sequences per forward/backward microbatch (at most, with micro_batch_tokens)")
    micro_batch_tokens: int = opt(0,
        "0 = microbatches of micro_batch_size rows, all padded to the minibatch's longest row. N > 0 = a token "
        "budget: rows (DPO pairs) sorted longest first and grouped so that rows x the group's longest row <= N "
        "(and rows <= micro_batch_size; a longer row is a microbatch of its own), each padded only to its own "
        "longest row (on GPU rounded up to a multiple of 64, which the budget counts); a row-mean loss is the same, the "
        "samples per optimizer step the same (token means within a microbatch, as GRPO's, PPO's and the RPO term's, "
        "move with the grouping: algorithms/base.py). Logged: train/padding_fraction. Pipeline stages exchange the "
        "varying shapes (only then). Size it from a rank's free memory: docs/scaling.md.")
    logits_chunk_mb: int = opt(0,
        "0 = each microbatch's logits are made at once (fastest: the LM head runs once); N = at most N MB of "
        "fp32 logits per TP rank at a time, each chunk recomputed in the backward (one more LM-head GEMM), so "
        "the LM head's memory is bounded: LLaMA-3's 128k vocabulary makes 4 GB of fp32 logits per 8k-token "
        "microbatch, and the loss several such tensors (learner/lm_head.py, docs/performance.md)")
    beta: float = opt(0.1, "DPO beta / KL coefficient")
    dpo_loss: Literal["sigmoid", "ipo"] = opt("sigmoid", "online_dpo: the DPO (sigmoid) or IPO loss")
    dpo_nll_coef: float = opt(0.0,
        "weight of an NLL term on the chosen completion added to the DPO loss (RPO, Pang et al. 2024: plain "
        "DPO lowers the chosen's likelihood too on math reasoning); 0 = the paper's plain DPO")
    clip_eps: float = opt(0.2, "PPO / GRPO / Proximal RLOO ratio clip")
    clip_eps_high: float | None = opt(None,
        "upper ratio clip of PPO and GRPO (DAPO's clip-higher, e.g. 0.28); null = clip_eps (symmetric)")
    off_policy_correction: Literal["auto", "none", "tis", "icepop", "decoupled"] = opt("auto",
        "correction of ppo, rloo, proximal_rloo and grpo against the generating policy's logprobs "
        "(algorithms/off_policy.py): none = the paper's losses; tis = truncated importance weights; icepop = "
        "weights outside [icepop_low, icepop_high] drop the token; decoupled = AReaL's decoupled PPO; auto = "
        "tis when rollout.max_lag != 0, none for the synchronous baseline")
    is_cap: float = opt(2.0, "tis: the importance weights' cap; decoupled: tokens whose weight exceeds it are dropped")
    icepop_low: float = opt(0.5, "icepop: lowest importance weight kept")
    icepop_high: float = opt(2.0, "icepop: highest importance weight kept")
    staleness_monitor: bool = opt(True,
        "log staleness/* every step: KL(generator || learner) on the trained tokens (k3), importance-weight "
        "mean, max and effective sample size; costs one forward pass per batch where the loss needs none")
    grpo_std_normalization: bool = opt(True, "grpo: divide advantages by the group's reward std (false = Dr. GRPO)")
    loss_aggregation: Literal["token", "sequence"] = opt("token",
        "grpo: mean over all completion tokens (token: DAPO, Dr. GRPO) or per completion, then over "
        "completions (sequence: the original GRPO)")
    grpo_kl_coef: float = opt(0.0, "grpo: weight of the k3 KL to the reference in the loss (0 = KL only logged)")
    vf_coef: float = opt(0.1, "PPO value loss weight")
    value_lr: float | None = opt(None,
        "PPO value model learning rate (its own Adam; the policy's schedule, scaled); None = trainer.lr")
    gamma: float = opt(1.0, "PPO discount")
    lam: float = opt(0.95, "PPO GAE lambda")
    checkpoint_every: int = opt(10, "steps between checkpoints (0 = only at the end)")
    async_save: bool = opt(True,
        "write each checkpoint in a background process (megatron-core's async save) while the learner goes on; "
        "`latest` moves once it is complete; a stop waits for it (docs/checkpoints.md)")
    eval_every: int = opt(0, "steps between pass@1 evaluations (0 = before and after only)")
    max_bad_steps: int = opt(3,
        "consecutive bad steps (NaN/inf loss or gradients, or no sample with a reward) before the run stops with "
        "an error; a run of fewer steps stops at its end if every step was bad (run/bad_steps.py)")


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
    replica_node: int = opt(0,
        "node rank hosting the vLLM replicas. Without a dedicated replica node only 0: they are then "
        "subprocesses of global rank 0, which a static torchrun rendezvous (--node-rank) puts on node 0.")
    dedicated_replica_node: bool = opt(False,
        "the replica node runs no learner ranks: `megatron-async serve-replica CFG --index i` runs replica i's "
        "vLLM server there (rollout.host:rollout.base_port + i, needs rollout.token), and learner rank 0's "
        "pool uses those URLs; torchrun spans nnodes - 1 nodes")
    gpus_per_node: int = opt(0, "GPUs per node; 0 = detect at launch. Ignored without CUDA.")
    learner_gpus: list | str = opt("auto",
        "CUDA ids of the learner ranks on each node (local rank i -> learner_gpus[i]); \"auto\" = every GPU "
        "of the node that is not a replica GPU (so the replica node may run fewer learner ranks)")
    replica_gpus: list | str = opt("auto",
        "CUDA ids for the replicas on the replica node, rollout.replica_tp consecutive ids per replica; "
        "\"auto\" = the node's last num_replicas x replica_tp GPUs")


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
