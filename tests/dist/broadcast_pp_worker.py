"""Worker for tests/test_broadcast_pp.py: a pipeline-parallel megatron learner -> the gloo wire ->
a real vLLM CPU replica (`mas_gloo`), through the trainer's own `WeightUpdate`.

    python -m torch.distributed.run --nproc-per-node N tests/dist/broadcast_pp_worker.py OUT BASE MODEL TP PP

Rank 0 starts a one-replica pool serving BASE. The learner (TP x PP on N ranks) is built from
MODEL, and `build_weight_update` gives each stage's sender rank a `BroadcastSender` of its own
stage (rollout.weight_transport=gloo): each stage streams its tensors over its own group into the
replica's one update session. Rounds, each a `WeightUpdate.push` on every rank:
  full      version 1: MODEL's weights as the learner loaded them;
  stepped   version 2: after one Adam step (the weights really change);
  raising   version 3: the last stage's stream carries one tensor of a wrong shape halfway (the
            replica's load_weights raises inside that stage's bucket): the update must publish
            nowhere and stop with WeightSyncError on every rank (one replica, up and refusing);
  resynced  version 3 again, to the replica the failure left behind (`replica_ids`: its groups
            formed anew), with the good weights.
After each round rank 0 samples from vLLM and every rank computes the learner's logprobs of the
sampled tokens (but after `raising`: rank 0 records which replicas need weights). Rank 0 writes
OUT/rounds.json: per round the records' versions, vLLM vs learner max |diff|, vLLM vs
transformers on MODEL (round `full` only), and the error of a push that raised.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.sync_parity_worker import PROMPT_LEN, microbatch, nll  # the same rows and loss

NEW_TOKENS, N = 10, 2
BAD_AT = 0.5  # the raising round's wrong tensor: this far into the last stage's stream


def with_a_bad_tensor(named, count: int):
    """The stream, with its tensor at BAD_AT replaced by one whose shape no parameter has."""
    for i, (name, tensor) in enumerate(named):
        yield (name, torch.zeros(3, 3)) if i == int(count * BAD_AT) else (name, tensor)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("base", type=Path)
    p.add_argument("model", type=Path)
    p.add_argument("tp", type=int)
    p.add_argument("pp", type=int)
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.config import load_config
    from megatron_async.learner.schedule import compute_logprobs
    from megatron_async.learner.mapping import iter_hf_weights, load_hf_weights
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer, train_step
    from megatron_async.learner.parallel import destroy_parallel, init_parallel
    from megatron_async.rollout import ReplicaPool, Sampling
    from megatron_async.weights.build import build_weight_update
    from megatron_async.weights.update import WeightSyncError
    from tests.rollout_fixtures import max_logprob_diff, spec

    layout = init_parallel(a.tp, a.pp)
    ctrl = dist.new_group(backend="gloo")
    cfg = load_config(None, ["rollout.weight_transport=gloo", "model.dtype=float32", "rollout.sync_bucket_mb=1",
                             "rollout.sync_timeout_s=60", f"parallel.tp={a.tp}", f"parallel.pp={a.pp}"])
    pool = None
    try:
        if layout.rank == 0:
            pool = ReplicaPool(spec(a.base, weight_backend="mas_gloo"), 1, log_dir=a.out / "logs",
                               request_timeout_s=120, start_timeout_s=300).start()
        where = [(pool.urls, pool.key) if pool else None]
        dist.broadcast_object_list(where, src=0)
        urls, key = where[0]
        model = build_model(a.model)
        load_hf_weights(model, a.model)
        ddp, opt, sched = build_optimizer(model, OptimSettings(lr=1e-2, clip_grad=1.0))
        weights = build_weight_update(cfg, layout, ctrl, pool, urls, key)
        count = sum(1 for _ in iter_hf_weights(ddp))  # the stream's length on this stage's sender
        vocab = model.arch.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (4, PROMPT_LEN), generator=g).tolist()
        rows = []
        for rnd, version, replica_ids in (("full", 1, None), ("stepped", 2, None), ("raising", 3, None),
                                          ("resynced", 3, [0])):
            if rnd == "stepped":
                batch = torch.randint(3, vocab, (4, PROMPT_LEN + NEW_TOKENS), generator=g).tolist()
                train_step(ddp, opt, sched, [microbatch(batch)], nll)
            named = iter_hf_weights(ddp)
            if rnd == "raising" and layout.is_last_stage and weights.sender is not None:
                named = with_a_bad_tensor(named, count)
            error = None
            try:
                weights.push(version, named, replica_ids)
            except WeightSyncError as e:
                error = str(e)
            if rnd == "raising":  # the replica is left out of dispatch until it is synced again
                if layout.rank == 0:
                    rows.append({"round": rnd, "version": version, "error": error,
                                 "needing_weights": [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)]})
                continue
            payload = [None]
            if layout.rank == 0:
                records = pool.generate(prompts, Sampling(n=N, max_tokens=NEW_TOKENS, ignore_eos=True, seed=version))
                payload = [[(list(r.prompt_token_ids) + list(r.token_ids), list(r.logprobs), r.policy_version)
                            for r in records]]
                hf_diff = max_logprob_diff(a.model, records) if rnd == "full" else None
            dist.broadcast_object_list(payload, src=0)
            seqs = [s for s, _, _ in payload[0]]
            vllm_lp = torch.tensor([lp for _, lp, _ in payload[0]])
            learner_lp = compute_logprobs(ddp, [microbatch(seqs)])[0][:, PROMPT_LEN:]
            if layout.rank == 0:
                rows.append({"round": rnd, "version": version, "error": error,
                             "record_versions": sorted({v for _, _, v in payload[0]}),
                             "learner_diff": (learner_lp - vllm_lp).abs().max().item(), "hf_diff": hf_diff})
        weights.close()
        if layout.rank == 0:
            (a.out / "rounds.json").write_text(json.dumps(rows, indent=1))
    finally:
        if pool is not None:
            pool.stop()
        destroy_parallel()


if __name__ == "__main__":
    main()
