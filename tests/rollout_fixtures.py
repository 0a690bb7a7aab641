"""Shared helpers for the rollout / weight-sync tests: tiny checkpoints, a transformers reference,
replica specs, one weight sync through the pool's update phases, a broadcast wire that kills its
replica inside a bucket, and process-tree checks.

Every model here is a random tiny LLaMA (megatron_async.models.tiny) sharing one tokenizer, so any
of them can be pushed into a replica started from another.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_async.models.tiny import TinyLlamaSpec, build_tiny_llama, build_tokenizer, default_corpus
from megatron_async.rollout import ReplicaPool, ReplicaSpec
from megatron_async.weights.update import PushResult, WeightUpdate

LOGPROB_TOL = 1e-3  # fp32 vLLM vs transformers, max |diff| (measured ~5e-7 on these models)
SMALL_BUCKET = 48 << 10  # splits q/k/v and gate/up of one layer over several buckets


def build_models(root: Path, seeds=(0, 1, 2)) -> list[Path]:
    """One tokenizer and a tiny LLaMA checkpoint per seed; returns the checkpoint dirs."""
    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    return [build_tiny_llama(root / f"model{s}", tok, seed=s) for s in seeds]


def build_variants(root: Path, hidden_size: int = 128, intermediate_size: int = 192) -> dict[str, Path]:
    """Architecture variants the learner and the weight sync must handle: GQA, tied embeddings,
    llama3 RoPE scaling, and Qwen2 (q/k/v biases, made non-zero). 2 layers, 4 heads / 2 KV groups.
    The default hidden 128 gives head_dim 32, the smallest vLLM's CPU attention takes; the learner
    tests (conftest's `tiny_ckpts`) use hidden 64."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(default_corpus(300), root / "tok", vocab_size=300)
    small = TinyLlamaSpec(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    out = {
        "gqa": build_tiny_llama(root / "gqa", tok, small, seed=1),
        "tied": build_tiny_llama(root / "tied", tok, dataclasses.replace(small, tie_word_embeddings=True), seed=2),
        "llama3": build_tiny_llama(root / "llama3", tok, dataclasses.replace(small, rope_scaling=llama3), seed=3),
    }
    cfg = Qwen2Config(vocab_size=320, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2)
    torch.manual_seed(4)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(root / "qwen2"))
    tok.save_pretrained(str(root / "qwen2"))
    out["qwen2"] = root / "qwen2"
    return out


def state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def perturbed(model_dir: Path, out_dir: Path, seed: int = 0, scale: float = 0.5) -> Path:
    """A copy of an HF checkpoint (any architecture) with every weight changed: w * (1 + scale * N(0, 1));
    the same names and shapes, so it can be pushed into a replica started from `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(out_dir))
    return Path(out_dir)


def sparsely_changed(model_dir: Path, out_dir: Path, fraction: float, seed: int) -> Path:
    """A copy of an HF checkpoint with `fraction` of each tensor's elements changed (x 1.5), as a
    bf16 sync after a small Adam step changes a few percent (weights/delta.py)."""
    shutil.copytree(model_dir, out_dir)
    gen = torch.Generator().manual_seed(seed)
    weights = state_dict(model_dir)
    for t in weights.values():
        pick = torch.rand(t.shape, generator=gen) < fraction
        t[pick] *= 1.5
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir


def spec(model_dir: Path, **overrides) -> ReplicaSpec:
    """A replica small enough for this CPU (fp32, 64 MiB of KV cache, 256 tokens)."""
    return dataclasses.replace(ReplicaSpec(model=str(model_dir), kv_cache_bytes=64 << 20, max_model_len=256), **overrides)


def sync(pool, model_dir: Path | None, version: int, replica_ids=None, *, named=None, mode="between_batches",
         transport: str = "auto", bucket_bytes: int = SMALL_BUCKET, timeout_s: float = 60.0,
         update=None) -> tuple[PushResult, list[int]]:
    """One weight update as learner rank 0 and a single stage sender run it, through
    `WeightUpdate.local`: `begin_update`, the stage's `HostMemorySender.push` into the replicas
    that opened, `finish_update(version)` on those the push reached (the others abandon it).
    Returns (push metrics, ids of the replicas that published `version`). `update`: a
    `WeightUpdate.local` the caller keeps across syncs, as the learner does (default: one with a
    new sender for this sync)."""
    from megatron_async.weights.host_memory import HostMemorySender

    if named is None:
        assert model_dir is not None, "sync takes its weights from model_dir or named"
        named = iter(state_dict(model_dir).items())
    if update is not None:  # a kept sender: `replica_ids` leaves the others out of this push, not a re-sync
        metrics = update.push(version, named, replica_ids, check=False, resync=False)
    else:
        with HostMemorySender(pool.urls, pool.key, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                              transport=transport) as sender:
            metrics = WeightUpdate.local(pool, sender, mode=mode, timeout_s=timeout_s).push(version, named, replica_ids,
                                                                                              check=False)
    assert metrics.opened, f"no replica opened the update: {pool.health_check()}"
    return metrics, metrics.published


class TrackedPool(ReplicaPool):
    """A ReplicaPool and what the tests keep track of on it: `held`, the checkpoint of its current
    version (set by every completed sync), and `next_version`, the version the next push publishes."""

    held: Path
    next_version: int = 1


def resync(pool: TrackedPool) -> None:
    """Hand a test's shared pool over with every replica up and on the current version: a replica
    an earlier test killed or left behind is waited for and given `pool.held` (the checkpoint of
    the current version) as the learner would."""
    behind = [r.replica_id for r in pool.replicas_needing_weights()]  # waits for a restarting replica
    if behind:
        _, done = sync(pool, pool.held, pool.current_version, behind)
        assert done == behind, f"re-sync of {behind} reached only {done}"
    assert not pool.replicas_needing_weights(wait_s=0)


def process_tree(pid: int) -> list:
    """psutil.Process of `pid` (a replica's supervisor) and all its descendants (server, engine core, workers)."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def gone(proc) -> bool:
    """Exited: no longer running (a zombie not yet reaped counts as exited)."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class KillingWire:
    """A broadcast wire (weights/broadcast.py's `Wire`) whose channels, once `arm`ed with a replica's
    pid, SIGKILL that replica's process group right after they started broadcasting the
    `at_bucket`-th bucket from then on: the replica dies inside that bucket. Fires once per `arm`."""

    def __init__(self, wire):
        self.wire, self.transport = wire, wire.transport
        self.pid: int | None = None  # armed: the replica to kill
        self.buckets_left = 0

    def arm(self, pid: int, at_bucket: int) -> None:
        self.pid, self.buckets_left = pid, at_bucket

    def open(self, *args):
        return KillingChannel(self.wire.open(*args), self)

    def started_bucket(self) -> None:
        if self.pid is None:
            return
        self.buckets_left -= 1
        if self.buckets_left == 0:
            os.killpg(self.pid, signal.SIGKILL)
            self.pid = None


class KillingChannel:
    def __init__(self, channel, wire: KillingWire):
        self.channel, self.wire = channel, wire

    def send(self, tensors):
        sent = self.channel.send(tensors)
        self.wire.started_bucket()
        return sent

    def destroy(self):
        self.channel.destroy()


def wait_for(cond, timeout_s: float, what: str, every_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(every_s)


def hf_logprobs(model_dir: Path, records) -> list[list[float]]:
    """transformers (fp32) logprobs of each record's completion tokens given its prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for r in records:
            ids = torch.tensor([list(r.prompt_token_ids) + list(r.token_ids)])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            pos = torch.arange(len(r.prompt_token_ids) - 1, ids.shape[1] - 1)
            out.append(logp[pos, torch.tensor(r.token_ids)].tolist())
    return out


def max_logprob_diff(model_dir: Path, records) -> float:
    """Largest |vLLM - transformers| over all sampled tokens of all records."""
    ref = hf_logprobs(model_dir, records)
    return max(abs(a - b) for r, lp in zip(records, ref) for a, b in zip(r.logprobs, lp))


def push_then_die(url: str, key: str, model_dir: str, die_at_tensor: int, timeout_s: float) -> None:
    """A sender process's gloo push of `model_dir` into the open update of the replica at `url`,
    SIGKILLed by itself when its stream reaches tensor `die_at_tensor` (buffers before it already
    broadcast): the sender goes away mid-push. Run in a child process (test_gloo_wire)."""
    from megatron_async.weights.broadcast import BroadcastSender, make_wire

    sender = BroadcastSender([url], key, wire=make_wire("gloo"), replica_tp=1, timeout_s=timeout_s,
                             bucket_bytes=SMALL_BUCKET)

    def stream():
        for i, item in enumerate(state_dict(Path(model_dir)).items()):
            if i == die_at_tensor:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item

    sender.push(stream())
