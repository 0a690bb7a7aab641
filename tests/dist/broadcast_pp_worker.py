"""Worker for tests/test_broadcast_pp.py: a TP x PP megatron learner -> the gloo wire -> two real vLLM
CPU replicas on this host (`mas_gloo`), through the trainer's own `WeightUpdate` (`build_weight_update`).

    python -m torch.distributed.run --nproc-per-node N tests/dist/broadcast_pp_worker.py OUT BASE MODEL TP PP

Rank 0 starts a two-replica pool serving BASE, once: the rounds that kill a replica leave its
restart to the pool. The replicas share a host (127.0.0.1), so each stage's sender reaches both
through ONE group (a node group, weights/broadcast.py), and the stages stream in turn
(`WeightUpdate.stage_turns`). The learner (TP x PP on N ranks) is built from MODEL, and
`build_weight_update` gives each stage's sender rank a `BroadcastSender` of its own stage
(rollout.weight_transport=gloo). The last stage's sender carries its wire in a `KillingWire`,
armed in round `killed` only. Rounds, each one or more `WeightUpdate.push` on every rank:
  full       v1: MODEL's weights as the learner loaded them, to both through each stage's node group;
  stepped    v2: after one Adam step (the weights really change), the groups reused;
  raising    v3: the last stage's stream carries one tensor of a wrong shape halfway (both replicas'
             load_weights raise inside that stage's buffers): the update publishes nowhere and does
             not stop (a node group failed whole: which replica refuses, only a re-sync alone tells);
             v3 again to both (`replica_ids`), each through a group of its own, with the same bad
             tensor: WeightSyncError on every rank (up and refusing); then v3 whole to both;
  killed     v4: the last stage's sender SIGKILLs replica 1's process group right after it started
             broadcasting its KILL_AT-th buffer: the node group fails whole, the push publishes
             nowhere and raises nowhere (replica 0 was only dropped with its group) and ends within
             the sender's timeout; v4 again to replica 0 at once (the trainer's re-sync: it serves,
             alone, while replica 1 restarts: round `survivor`), then, once the pool restarted
             replica 1, v4 to it (it catches up);
  restarted  v5: rank 0 SIGKILLs replica 0 between pushes (the senders still hold its groups); once
             the pool restarted it, the regular push of v5 reaches replica 1 only (a replica back from
             a failure is left out of a full update), and the re-sync (`replica_ids`) reaches it;
  regrouped  v6: a regular push re-forms each stage's node group with both.
After each round rank 0 samples from vLLM and every rank computes the learner's logprobs of the
sampled tokens (`sample_and_compare`). Rank 0 writes OUT/rounds.json: per push its round, version,
error (a WeightSyncError's), the replicas it opened on and published on, its seconds, and per
stage sender the buffers it streamed, the replicas it dropped (and of those, with their node
group) and its groups after the push; per round the records' versions and replicas, vLLM vs
learner max |diff|, and vLLM vs transformers on MODEL (round `full` only).
"""
import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.sync_parity_worker import NEW_TOKENS, PROMPT_LEN, microbatch, nll, sample_and_compare

BAD_AT = 0.5  # the raising round's wrong tensor: this far into the last stage's stream
KILL_AT = 3  # the killed round: the last stage's buffer inside which replica 1 dies
REPLICAS = 2
SYNC_TIMEOUT_S = 30  # rollout.sync_timeout_s: a raising load costs the sender this long (see the docs)
# the senders' bucket cap: rollout.sync_bucket_mb counts whole MiB, and a stage of the tiny model is
# ~1.6 MB (2 of its 4 layers): at this cap each stage streams 6-7 buckets
BUCKET_BYTES = 256 << 10


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
    from megatron_async.learner.mapping import iter_hf_weights
    from megatron_async.learner.optimizer import OptimSettings, train_step
    from megatron_async.learner.parallel import destroy_parallel, from_rank0, init_parallel
    from megatron_async.rollout import ReplicaPool
    from megatron_async.weights.broadcast import BroadcastSender
    from megatron_async.weights.build import build_weight_update
    from megatron_async.run_plan import build_plan
    from megatron_async.weights.update import WeightSyncError
    from tests.dist._learner import tiny_learner
    from tests.rollout_fixtures import KillingWire, max_logprob_diff, spec, wait_for

    layout = init_parallel(a.tp, a.pp)
    ctrl = dist.new_group(backend="gloo")
    cfg = load_config(None, ["rollout.weight_transport=gloo", "model.dtype=float32", f"rollout.sync_timeout_s={SYNC_TIMEOUT_S}",
                             f"parallel.tp={a.tp}", f"parallel.pp={a.pp}"])
    pool = None
    try:
        if layout.rank == 0:
            pool = ReplicaPool(spec(a.base, weight_backend="mas_gloo"), REPLICAS, log_dir=a.out / "logs",
                               request_timeout_s=120, start_timeout_s=300).start()
        urls, key = from_rank0((pool.urls, pool.key) if pool is not None else None, ctrl)
        ddp, opt, sched = tiny_learner(a.model, OptimSettings(lr=1e-2, clip_grad=1.0))
        weights = build_weight_update(cfg, build_plan(cfg), layout, ctrl, pool, urls, key)
        sender = weights.sender
        assert sender is None or isinstance(sender, BroadcastSender), sender  # rollout.weight_transport=gloo
        last_sender = layout.is_last_stage and sender is not None
        if sender is not None:
            sender.bucket_bytes = BUCKET_BYTES
            if last_sender:
                sender.wire = killing = KillingWire(sender.wire)
        count = sum(1 for _ in iter_hf_weights(ddp))  # the stream's length on this stage's sender
        vocab = ddp.arch.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (4, PROMPT_LEN), generator=g).tolist()
        pushes, rounds = [], []

        def push(rnd: str, version: int, replica_ids=None, bad: bool = False) -> None:
            named = iter_hf_weights(ddp)
            if bad and last_sender:
                named = with_a_bad_tensor(named, count)
            error, t0 = None, time.monotonic()
            try:
                result = weights.push(version, named, replica_ids)
            except WeightSyncError as e:
                error, result = str(e), None
            seconds = time.monotonic() - t0
            sent = None if sender is None or result is None else \
                {"stage": layout.pp_rank, "buckets": result.buckets, "failed": sorted(result.failed),
                 "failed_with_group": sorted(result.failed_with_group),
                 "groups": [[urls.index(u) for u in members] for members in sender.groups]}
            senders: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(senders, sent, group=ctrl)
            if layout.rank == 0:  # one line per push: where the time went, in a failing run's tail too
                print(f"{time.strftime('%H:%M:%S')} push {rnd} v{version} to {replica_ids or 'all'}: {seconds:.1f} s, "
                      f"{error or 'no error'}", flush=True)
                pushes.append({"round": rnd, "version": version, "error": error, "seconds": seconds,
                               "opened": None if result is None else result.opened,
                               "published": None if result is None else result.published,
                               "senders": sorted((s for s in senders if s is not None), key=lambda s: s["stage"])})

        def restarted(replica: int, pid: int) -> None:
            """Rank 0: wait until the pool restarted `replica` (whose process was `pid`) and it needs
            weights (the pool's health check, which `replicas_needing_weights` runs, finds it dead)."""
            if (live := pool) is not None:
                wait_for(lambda: replica in [r.replica_id for r in live.replicas_needing_weights(wait_s=0)]
                         and live.pids()[replica] not in (None, pid),
                         timeout_s=300, what=f"replica {replica} restarted", every_s=0.5)

        def sample(rnd: str, version: int) -> None:
            sampled = sample_and_compare(ddp, pool, prompts, seed=version)
            if pool is not None:  # rank 0
                rounds.append({"round": rnd, "version": version, "record_versions": sampled.versions,
                               "record_replicas": sorted({r.replica_id for r in sampled.records or []}),
                               "learner_diff": sampled.learner_diff,
                               "hf_diff": max_logprob_diff(a.model, sampled.records) if rnd == "full" else None,
                               "needing_weights": [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)]})

        push("full", 1)
        sample("full", 1)

        batch = torch.randint(3, vocab, (4, PROMPT_LEN + NEW_TOKENS), generator=g).tolist()
        train_step(ddp, opt, sched, [microbatch(batch)], nll)
        push("stepped", 2)
        sample("stepped", 2)

        push("raising", 3, bad=True)
        if pool is not None:  # rank 0: left out of dispatch until it is synced again
            pushes[-1]["needing_weights"] = [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)]
        push("raising", 3, [0, 1], bad=True)
        push("raising", 3, [0, 1])
        sample("raising", 3)

        pid = from_rank0(pool.pids()[1] if pool is not None else None, ctrl)
        if last_sender:
            killing.arm(pid, KILL_AT)
        push("killed", 4)
        if pool is not None:  # rank 0: what the trainer's wait re-syncs next: replica 1 is restarting, not up
            pushes[-1]["needing_weights"] = [r.replica_id for r in pool.replicas_needing_weights(wait_s=0)]
        push("killed", 4, [0])
        sample("survivor", 4)
        restarted(1, pid)
        push("killed", 4, [1])
        sample("killed", 4)

        pid = from_rank0(pool.pids()[0] if pool is not None else None, ctrl)
        if pool is not None:
            os.killpg(pid, signal.SIGKILL)
            restarted(0, pid)
        push("restarted", 5)
        push("restarted", 5, [0])
        sample("restarted", 5)

        push("regrouped", 6)
        sample("regrouped", 6)

        weights.close()
        if layout.rank == 0:
            (a.out / "rounds.json").write_text(json.dumps({"pushes": pushes, "rounds": rounds,
                                                           "stage_turns": weights.stage_turns}, indent=1))
    finally:
        if pool is not None:
            pool.stop()
        destroy_parallel()


if __name__ == "__main__":
    main()
