"""Multi-node launch and placement.

The slow test runs a two-"node" job on this machine the way `launch/multi_node.sh` does on real
nodes: two torchrun agents (`--nnodes=2 --node-rank={0,1}`, static rendezvous on 127.0.0.1, gloo),
one learner rank each, `parallel.tp=2` so the tensor-parallel group spans both nodes, and the vLLM
replica started by node 0's rank 0. A second one runs a dedicated replica node: a
`megatron-async serve-replicas` process plays node 1 and starts the replica, a torchrun learner
(PP=2) plays node 0. The other tests check the placement config (GPU splits, fits, reachability
of loopback replicas) without GPUs, by giving `placement.gpus_per_node`.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_async.config import ConfigError, load_config
from megatron_async.run.preflight import preflight
from megatron_async.cluster.placement import check_fit, node_layout
from tests.e2e_utils import RLOO, assert_one_step_off_policy, assert_trained, coin_flip_data, metrics
from tests.e2e_utils import SMALL as E2E_SMALL

REPO = Path(__file__).resolve().parents[1]
CFG = str(REPO / "configs" / "cpu_tiny.yaml")
STEPS = 3
SMALL = [*E2E_SMALL, *RLOO, "sft.steps=20", f"trainer.steps={STEPS}", "trainer.checkpoint_every=0",
         "rollout.max_new_tokens=32"]  # later overrides win


# node 1 hosts only replicas (served by `megatron-async serve-replicas`), node 0 only learner ranks
DEDICATED = ["placement.nnodes=2", "placement.dedicated_replica_node=true", "placement.replica_node=1",
             "rollout.host=10.0.0.2", "rollout.token=s3cret"]


def gpu_cfg(*overrides):
    """A config as a login node would validate it before launch: 8 GPUs per node, no CUDA here."""
    cfg = load_config(CFG, ["placement.gpus_per_node=8", *overrides])
    preflight(cfg)
    return cfg


# ----------------------------------------------------------------------------- placement (fast)


def test_auto_split_reserves_replica_gpus_on_node0_only():
    cfg = gpu_cfg("placement.nnodes=2", "rollout.num_replicas=2", "rollout.replica_tp=2", "parallel.tp=2")
    node0, node1 = check_fit(cfg, 8, None)
    assert node0.replicas == [[4, 5], [6, 7]] and node0.learner == [0, 1, 2, 3]
    assert node1.replicas == [] and node1.learner == list(range(8))


def test_explicit_lists():
    cfg = gpu_cfg("placement.learner_gpus=[0,1]", "placement.replica_gpus=[7,6]", "rollout.num_replicas=2")
    lay = node_layout(cfg, 0, 8)
    assert lay.learner == [0, 1] and lay.replicas == [[7], [6]]


@pytest.mark.parametrize("overrides, key, words", [
    (["placement.learner_gpus=[0,1,2]", "placement.replica_gpus=[2,3]"], "placement.learner_gpus", "overlaps"),
    (["placement.replica_gpus=[6]", "rollout.num_replicas=2"], "placement.replica_gpus", "cannot hold"),
    (["placement.replica_gpus=[8]"], "placement.replica_gpus", "only 8 GPUs"),
    (["rollout.num_replicas=8"], "rollout.num_replicas", "leaves none"),
    (["parallel.world_size=8"], "parallel.world_size", "7 learner GPUs"),
    (["placement.learner_gpus=[0,1,2]", "parallel.tp=2"], "placement.learner_gpus", "not a multiple"),
    (["placement.nnodes=2", "placement.replica_node=1"], "placement.replica_node", "dedicated_replica_node"),
    (["placement.dedicated_replica_node=true"], "placement.dedicated_replica_node", "nnodes >= 2"),
    (DEDICATED[:-2], "rollout.token", "shared secret"),
    ([*DEDICATED, "rollout.num_replicas=9"], "rollout.num_replicas", "exceeds node 1's 8 GPUs"),
    ([*DEDICATED, "rollout.base_port=29508", "rollout.num_replicas=4"], "placement.replica_server_port", "replica port"),
    # every learner rank is on node 0: loopback replicas on the dedicated node 1 are out of reach
    ([*DEDICATED[:-2], "rollout.token=s3cret"], "rollout.host", "node 1's address"),
    (["placement.replica_node=1"], "placement.replica_node", "[0, 1)"),
    (["placement.learner_gpus=all"], "placement.learner_gpus", "auto"),
    (["placement.learner_gpus=[0,0]"], "placement.learner_gpus", "twice"),
    (["rollout.base_port=80"], "rollout.base_port", "1024"),
    # PP stage 1's sender (rank 6 of 12) is on node 1: loopback replicas on node 0 are out of reach
    (["placement.nnodes=2", "parallel.tp=2", "parallel.pp=2", "rollout.num_replicas=4"], "rollout.host", "stage 1"),
])
def test_layouts_that_do_not_fit_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        gpu_cfg(*overrides)
    assert f"'{key}'" in str(e.value) and words in str(e.value)


def test_routable_host_lets_senders_on_other_nodes_reach_the_replicas():
    cfg = gpu_cfg("placement.nnodes=2", "parallel.tp=2", "parallel.pp=2", "rollout.num_replicas=4",
                  "rollout.host=10.0.0.1", "rollout.token=s3cret")
    assert [len(n.learner) for n in check_fit(cfg, 8, 12)] == [4, 8]


def test_gpu_lists_are_ignored_without_a_gpu_count():
    # on a CPU machine (gpus_per_node=0, no CUDA) only the static checks apply
    preflight(load_config(CFG, ["placement.learner_gpus=[0,1,2,3]", "placement.replica_gpus=[4]",
                                "parallel.world_size=2"]))


@pytest.mark.integration  # the CLI as a subprocess
def test_placement_command_prints_each_nodes_nproc():
    base = [sys.executable, "-m", "megatron_async", "placement"]
    args = [CFG, "placement.nnodes=2", "placement.gpus_per_node=8", "rollout.num_replicas=2", "parallel.tp=2"]
    out = [subprocess.run([*base, "--node-rank", str(n), *args], capture_output=True, text=True, check=True).stdout
           for n in (0, 1)]
    assert "NPROC_PER_NODE=6\nLEARNER_GPUS=0,1,2,3,4,5\nREPLICA_GPUS=6,7\nWORLD_SIZE=14" in out[0]
    assert "NPROC_PER_NODE=8\n" in out[1] and "REPLICA_GPUS=\n" in out[1]


@pytest.mark.integration  # the CLI as a subprocess
def test_dedicated_replica_node_runs_no_learner_ranks():
    cfg = gpu_cfg(*DEDICATED, "rollout.num_replicas=8", "parallel.tp=2", "placement.learner_gpus=[0,1,2,3,4,5,6,7]")
    node0, node1 = check_fit(cfg, 8, 8)  # explicit learner ids apply to learner nodes only
    assert node0.learner == list(range(8)) and node0.replicas == []
    assert node1.learner == [] and node1.replicas == [[i] for i in range(8)]
    base = [sys.executable, "-m", "megatron_async", "placement", CFG, *DEDICATED, "placement.gpus_per_node=8",
            "rollout.num_replicas=8", "parallel.tp=2", "--node-rank"]
    out = [subprocess.run([*base, str(n)], capture_output=True, text=True, check=True).stdout for n in (0, 1)]
    assert "NPROC_PER_NODE=8\n" in out[0] and "TORCHRUN_NNODES=1\nTORCHRUN_NODE_RANK=0\n" in out[0]
    assert "NPROC_PER_NODE=0\n" in out[1] and "REPLICA_GPUS=0,1,2,3,4,5,6,7\n" in out[1]
    assert "TORCHRUN_NODE_RANK=\n" in out[1]


@pytest.mark.integration  # the CLI as a subprocess
def test_train_refuses_a_node_count_torchrun_did_not_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_async", "train", CFG, "placement.nnodes=2",
                           f"run.out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "key 'placement.nnodes' = 2: torchrun started 1 node(s)" in proc.stderr
    assert not (tmp_path / "cpu_tiny").exists()  # refused before building anything


# ----------------------------------------------------------------------------- two nodes, end to end


@pytest.mark.integration
@pytest.mark.slow
def test_two_node_job_tp_across_nodes(tmp_path):
    from megatron_async.learner.parallel import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    data = coin_flip_data(tmp_path)  # reward spread: a learning signal (e2e_utils.assert_trained)
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "megatron_async", "train", CFG, *SMALL, *data, "parallel.tp=2", "placement.nnodes=2",
               f"run.out_dir={tmp_path}"]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    try:
        codes = [p.wait(timeout=600) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], f"exit codes {codes}:\n{logs[0][-4000:]}\n----- node 1\n{logs[1][-4000:]}"

    run_dir = tmp_path / "cpu_tiny"
    assert_trained(run_dir, STEPS)  # RLOO trained on every batch and the weights moved
    m = metrics(run_dir)
    steps = list(range(STEPS))
    # one step off-policy across the two-node learner: batch s generated by version max(0, s - 1)
    assert_one_step_off_policy(m, STEPS)
    assert sorted(m["train/loss"]) == steps and sorted(m["timing/sync_s"]) == steps
    # step 0: the TP=2 learner split over two nodes and vLLM agree on version 0's logprobs
    assert m["logprob_diff/learner_vs_generator"][0] < 1e-3
    # rank 0 (which starts the replica) ran under node 0's agent; node 1's agent ran the other rank
    # (TP=2 over two agents of one rank each: the job cannot finish unless both took part)
    assert (run_dir / "replicas" / "replica0.log").exists()
    assert "[rank0]" in logs[0] and "[rank0]" not in logs[1]
    assert (run_dir / "hf_final" / "config.json").exists()


# ----------------------------------------------------------------------------- a dedicated replica node


def serve_replicas(port: int, out_dir: Path, *overrides: str) -> subprocess.Popen:
    """`megatron-async serve-replicas` as node 1 would run it, its output in out_dir/host.log."""
    cmd = [sys.executable, "-m", "megatron_async", "serve-replicas", CFG, *SMALL, *LOCAL_DEDICATED,
           f"placement.replica_server_port={port}", f"run.out_dir={out_dir}", *overrides, "--wait-s", "600"]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "host.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})


# both "nodes" on 127.0.0.1: loopback is reachable here because it is one machine (check_reachable)
LOCAL_DEDICATED = ["placement.nnodes=2", "placement.dedicated_replica_node=true", "placement.replica_node=1",
                   "rollout.token=test-token"]


@pytest.mark.integration
@pytest.mark.slow
def test_pool_fails_clearly_when_the_replica_host_dies(tmp_path):
    from megatron_async.learner.parallel import free_port
    from megatron_async.rollout import PoolError, ReplicaPool, Sampling
    from tests.rollout_fixtures import build_models, spec

    model = build_models(tmp_path / "models", seeds=(0,))[0]
    port = free_port()
    host = serve_replicas(port, tmp_path / "node1")
    try:
        with ReplicaPool(spec(model), 1, authkey="test-token", server=("127.0.0.1", port), request_timeout_s=60) as pool:
            records = pool.generate([[1, 5, 6], [1, 7]], Sampling(n=2, max_tokens=8, seed=0))
            assert len(records) == 4 and {r.replica_id for r in records} == {0}
            replica = psutil.Process(pool.pids()[0])
            assert replica.ppid() == host.pid  # the replica is the host's child, not this process's
            host.send_signal(signal.SIGKILL)
            replica.wait(timeout=10)  # it watches its parent and exits with it
            t0 = time.monotonic()
            with pytest.raises(PoolError, match=rf"replica host at 127.0.0.1:{port} is gone"):
                pool.generate([[1, 5, 6]], Sampling(n=1, max_tokens=8, seed=0))
            assert time.monotonic() - t0 < 30
    finally:
        if host.poll() is None:
            host.kill()
        host.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_dedicated_replica_node_job(tmp_path):
    """Node 1: serve-replicas with the replica; node 0: a torchrun learner with PP=2 (two senders)."""
    from megatron_async.learner.parallel import free_port

    port, master = free_port(), free_port()
    data = coin_flip_data(tmp_path)  # reward spread: a learning signal (e2e_utils.assert_trained)
    host = serve_replicas(port, tmp_path / "node1", *data)
    learner_dir = tmp_path / "node0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={master}", "-m", "megatron_async", "train", CFG, *SMALL,
           *data, *LOCAL_DEDICATED, "parallel.pp=2", f"placement.replica_server_port={port}", f"run.out_dir={learner_dir}"]
    learner_dir.mkdir()
    with open(learner_dir / "learner.log", "w") as log:
        learner = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        codes = [learner.wait(timeout=600), host.wait(timeout=60)]  # the host exits when the session ends
    finally:
        for p in (learner, host):
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(learner_dir / "learner.log").read_text(), (tmp_path / "node1" / "host.log").read_text()]
    assert codes == [0, 0], f"exit codes {codes}:\n{logs[0][-4000:]}\n----- replica host\n{logs[1][-3000:]}"

    run_dir = learner_dir / "cpu_tiny"
    assert_trained(run_dir, STEPS)
    m = metrics(run_dir)
    # one step off-policy: batch s was generated by version max(0, s - 1) on the host's replica, so
    # the weights of versions 1.. reached it from both pipeline stages' senders
    assert_one_step_off_policy(m, STEPS)
    assert m["logprob_diff/learner_vs_generator"][0] < 1e-3  # PP=2 learner vs the host's vLLM, version 0
    # the final evaluation ran on the replica holding the learner's final version
    versions = lambda tag: {r["policy_version"] for r in json.loads((run_dir / f"eval_{tag}.json").read_text())["results"]}  # noqa: E731
    assert versions("before") == {0} and versions("after") == {STEPS}
    # the replica ran under the host ("node 1"), and it is the one the learner's pool used
    served = re.search(r"replica 0 serves on 127\.0\.0\.1:(\d+) \(pid (\d+)\)", logs[1])
    assert served and "learner session from pid" in logs[1], logs[1][-3000:]
    assert re.search(rf"replicas on \S+: 127\.0\.0\.1:{served[1]} \(pids \[{served[2]}\]\)", logs[0]), logs[0][-3000:]
    assert "serving on 127.0.0.1" in (tmp_path / "node1" / "cpu_tiny" / "replicas" / "replica0.log").read_text()
    assert not (run_dir / "replicas").exists()  # no replica was started on the learner's side
