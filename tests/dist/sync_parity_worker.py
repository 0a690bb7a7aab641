"""Worker for tests/test_sync_parity.py: megatron learner -> weight sync -> vLLM, logprob parity.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/sync_parity_worker.py OUT MODEL_DIR... [--dtype bfloat16]

Rank 0 starts a one-replica ReplicaPool per model (as the trainer's driver rank would; all at
once, their ~30 s start-ups overlap) and broadcasts their URLs and keys. Then, for each layout TP=1 (x DP=2), TP=2 and PP=2, the
learner is built from the HF checkpoint and runs ROUNDS rounds of: (from round 1 on) one Adam
step, so the weights really change -> rank 0 opens a vLLM weight update (`pool.begin_update`), every
stage's source rank pushes `iter_hf_weights` with a HostMemorySender, over shared memory in rounds 0
and 2 and inline over HTTP in round 1 (the other ranks iterate along for the gathers), rank 0
publishes the version (`pool.finish_update`) -> rank 0 samples from vLLM ->
every rank computes the learner's logprobs of the sampled tokens. Rank 0 writes OUT/parity.json:
one row per (model, layout, round) with vLLM-vs-learner max |diff|, how much the step moved the
previous round's logprobs, how many replicas published the version, and the dtypes pushed.
`--dtype bfloat16`: a bf16 learner (fp32 main weights in its optimizer) and bf16 replicas, the GPU's
pair (model.dtype: bfloat16); default: fp32 both.
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # megatron (schedule's import) is imported in the functions that run it
    from megatron_async.learner.schedule import Tokens

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks
ROUNDS = 3
TRANSPORTS = ("shm", "http", "shm")  # per round
PROMPT_LEN, NEW_TOKENS, N = 4, 12, 2
GENERATE_TIMEOUT_S = 120  # a few seconds when a replica serves; a dead one fails the round, not the whole test's timeout


def nll(logprobs, mb):
    mask = mb["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {}


def microbatch(sequences: list[list[int]]) -> Tokens:
    ids = torch.tensor(sequences)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, PROMPT_LEN:] = 1.0
    return {"input_ids": ids, "loss_mask": mask}


@dataclass
class Sampled:
    """One sample from the replicas, compared with the learner: rank 0's records (None elsewhere);
    on every rank the sampled sequences, vLLM's logprobs of their new tokens, the versions they were
    sampled under, and the learner's max |diff| from vLLM on those tokens."""

    records: list | None
    seqs: list[list[int]]
    vllm_lp: torch.Tensor
    versions: list[int]
    learner_diff: float


def sample_and_compare(ddp, pool, prompts: list[list[int]], seed: int) -> Sampled:
    """Every rank: rank 0 samples N completions of NEW_TOKENS per prompt from `pool` (None
    elsewhere) and broadcasts them; every rank computes the learner's logprobs of the same tokens."""
    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.rollout import Sampling

    payload: list[Any] = [None]
    records = None
    if dist.get_rank() == 0:
        records = pool.generate(prompts, Sampling(n=N, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed),
                                timeout_s=GENERATE_TIMEOUT_S)
        payload = [[(list(r.prompt_token_ids) + list(r.token_ids), list(r.logprobs), r.policy_version) for r in records]]
    dist.broadcast_object_list(payload, src=0)
    seqs = [s for s, _, _ in payload[0]]
    vllm_lp = torch.tensor([lp for _, lp, _ in payload[0]])
    learner_lp = compute_logprobs(ddp, [microbatch(seqs)])[0][:, PROMPT_LEN:]
    return Sampled(records, seqs, vllm_lp, sorted({v for _, _, v in payload[0]}),
                   (learner_lp - vllm_lp).abs().max().item())


def recording_dtypes(named, seen: set):
    """`named` (name, tensor) pairs passed through, each tensor's dtype added to `seen`."""
    for name, tensor in named:
        seen.add(str(tensor.dtype))
        yield name, tensor


def run_layout(model_dir: Path, tp: int, pp: int, pool, urls, key, first_version: int,
               dtype: torch.dtype) -> list[dict]:
    from megatron.core import parallel_state as ps

    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from megatron_async.learner.parallel import init_parallel
    from megatron_async.learner.mapping import iter_hf_weights
    from megatron_async.weights.host_memory import HostMemorySender
    from tests.dist._learner import tiny_learner

    init_parallel(tp, pp)
    ddp, opt, sched = tiny_learner(model_dir, OptimSettings(lr=1e-2, clip_grad=1.0), dtype)
    source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    senders = {t: HostMemorySender(urls, key, timeout_s=60, bucket_bytes=256 << 10, transport=t)
               for t in set(TRANSPORTS)} if source else {}
    vocab = ddp.arch.vocab_size
    g = torch.Generator().manual_seed(first_version)
    prompts = torch.randint(3, vocab, (4, PROMPT_LEN), generator=g).tolist()
    rows, prev = [], None
    for rnd in range(ROUNDS):
        version = first_version + rnd
        if rnd:
            train_step(ddp, opt, sched, [microbatch(torch.randint(3, vocab, (4, PROMPT_LEN + NEW_TOKENS), generator=g).tolist())], nll)
        opened: list[Any] = [pool.begin_update(None, "between_batches", 60) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(opened, src=0)
        pushed_dtypes: set = set()
        named = recording_dtypes(iter_hf_weights(ddp), pushed_dtypes)
        if source:
            sync = senders[TRANSPORTS[rnd]].push(named)
        else:
            sync = None
            for _ in named:  # no-op loop on non-source ranks; they take part in the TP gathers
                pass
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, sorted(sync.failed if sync is not None else {}))
        published = [0]
        if dist.get_rank() == 0:
            complete = opened[0] if not any(failed) else []
            published = [len(pool.finish_update(version, complete, [i for i in opened[0] if i not in complete]))]
        dist.broadcast_object_list(published, src=0)
        sampled = sample_and_compare(ddp, pool, prompts, seed=rnd)
        moved = None
        if prev is not None:  # the step changed the policy: previous tokens' logprobs moved
            moved = (compute_logprobs(ddp, [microbatch(prev.seqs)])[0][:, PROMPT_LEN:] - prev.vllm_lp).abs().max().item()
        prev = sampled
        rows.append({
            "model": model_dir.name, "tp": tp, "pp": pp, "round": rnd, "version": version,
            "record_versions": sampled.versions, "records": len(sampled.seqs),
            "max_diff": sampled.learner_diff, "moved": moved,
            "published": published[0], "buckets": None if sync is None else sync.buckets, "transport": TRANSPORTS[rnd],
            "pushed_dtypes": sorted(pushed_dtypes) if source else None,
        })
    for sender in senders.values():
        sender.close()
    ps.destroy_model_parallel()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="learner and replicas")
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.rollout import ReplicaPool, ReplicaSpec

    init_parallel(1, 1)  # the default process group; each layout re-initialises megatron's groups
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    rows = []
    try:
        pools = {}
        if dist.get_rank() == 0:
            pools = {m: ReplicaPool(ReplicaSpec(model=str(m), dtype=a.dtype, kv_cache_bytes=64 << 20, max_model_len=256), 1,
                                    log_dir=a.out / f"logs-{m.name}") for m in a.models}
            with ThreadPoolExecutor(len(pools)) as ex:
                list(ex.map(ReplicaPool.start, pools.values()))
        info = [{m: (p.urls, p.key) for m, p in pools.items()}]
        dist.broadcast_object_list(info, src=0)
        try:
            for model_dir in a.models:
                urls, key = info[0][model_dir]
                for i, (tp, pp) in enumerate(LAYOUTS):
                    rows += run_layout(model_dir, tp, pp, pools.get(model_dir), urls, key, first_version=1 + i * ROUNDS,
                                       dtype=getattr(torch, a.dtype))
        finally:
            for pool in pools.values():
                pool.stop()
        if dist.get_rank() == 0:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "parity.json").write_text(json.dumps(rows, indent=1))
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
