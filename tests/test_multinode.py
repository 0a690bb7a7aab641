"""Multi-node launch and placement.

The slow test runs a two-"node" job on this machine the way `launch/multi_node.sh` does on real
nodes: two torchrun agents (`--nnodes=2 --node-rank={0,1}`, static rendezvous on 127.0.0.1, gloo),
one learner rank each, `parallel.tp=2` so the tensor-parallel group spans both nodes, and the vLLM
replica started by node 0's rank 0. A second one runs a dedicated replica node:
`megatron-async serve-replica --index 0` plays node 1 (vLLM's server), a torchrun learner (PP=2)
plays node 0 and uses its URL; another checks what a pool of such URLs does when the server dies.
The other tests check the placement config (GPU splits, fits, reachability of loopback replicas)
without GPUs, by giving `placement.gpus_per_node`.
"""
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_async.config import ConfigError, load_config
from megatron_async.run_plan import load_plan
from megatron_async.run.preflight import preflight
from megatron_async.cluster.placement import check_fit, node_layout
from tests.e2e_utils import RLOO, assert_one_step_off_policy, assert_trained, coin_flip_data, metrics
from tests.e2e_utils import SMALL as E2E_SMALL

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("in_an_empty_folder")  # runs/ of the default run.out_dir: tests/conftest.py
CFG = str(REPO / "configs" / "cpu_tiny.yaml")
STEPS = 3
SMALL = [*E2E_SMALL, *RLOO, "sft.steps=20", f"trainer.steps={STEPS}", "trainer.checkpoint_every=0",
         "rollout.max_new_tokens=32"]  # later overrides win


# node 1 hosts only replicas (`megatron-async serve-replica --index i` each), node 0 only learner ranks
DEDICATED = ["placement.nnodes=2", "placement.dedicated_replica_node=true", "placement.replica_node=1",
             "rollout.base_port=29600", "rollout.host=10.0.0.2", "rollout.token=s3cret"]


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
    (["placement.dedicated_replica_node=true", "rollout.base_port=29600"], "placement.dedicated_replica_node",
     "nnodes >= 2"),
    (DEDICATED[:-2], "rollout.token", "shared secret"),
    ([*DEDICATED, "rollout.num_replicas=9"], "rollout.num_replicas", "exceeds node 1's 8 GPUs"),
    ([*DEDICATED, "rollout.base_port=0"], "rollout.base_port", "replica i listens on rollout.base_port + i"),
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
    # the run folder was taken by one process, rank 0 (run/run_lock.py; node 1's rank, whose INFO
    # lines go to its train.rank1.log, never tried), and released at the end
    taken = [n for n, text in enumerate(logs) for line in text.splitlines() if "taken by this run" in line]
    assert taken == [0], taken
    assert not any("run folder" in p.read_text() for p in run_dir.glob("train.rank*.log"))
    assert not (run_dir / "run.lock").exists()


# ----------------------------------------------------------------------------- a dedicated replica node

TOKEN = "test-token"
# both "nodes" on 127.0.0.1: loopback is reachable here because it is one machine (check_reachable)
LOCAL_DEDICATED = ["placement.nnodes=2", "placement.dedicated_replica_node=true", "placement.replica_node=1",
                   f"rollout.token={TOKEN}"]


def serve_replica(out_dir: Path, port: int, *overrides: str) -> subprocess.Popen:
    """`megatron-async serve-replica CFG --index 0` as node 1 runs it: vLLM's server for replica 0 on
    127.0.0.1:port, in a session of its own (killpg ends its engine processes too); its output is
    appended to out_dir/serve.log."""
    cmd = [sys.executable, "-m", "megatron_async", "serve-replica", CFG, "--index", "0", *SMALL, *overrides,
           f"rollout.token={TOKEN}", f"rollout.base_port={port}", f"run.out_dir={out_dir}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "serve.log", "a") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole session (the API server, its engine core, workers) and reap them."""
    members = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))] \
        if proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs([psutil.Process(p) for p in members if psutil.pid_exists(p)], timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def restart_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("replica-restart") and t.is_alive()]


@pytest.mark.integration
@pytest.mark.slow
def test_pool_of_replica_urls_when_their_server_dies(tmp_path):
    """A pool given `urls=` (servers started elsewhere: not restarted by it). When the server is
    SIGKILLed, a pool with max_failures=0 fails at once; one with max_failures=1 waits up to its
    start_timeout_s for the server to answer again, then fails; and when it does answer again (a new
    server on the same port), the replica rejoins only after a weight push (it holds its launcher's
    weights, not necessarily the pool's current ones)."""
    from megatron_async.learner.parallel import free_port
    from megatron_async.rollout import PoolError, ReplicaPool, ReplicaSpec, Sampling
    from megatron_async.weights.host_memory import HostMemorySender
    from tests.rollout_fixtures import state_dict

    port, node1 = free_port(), tmp_path / "node1"
    url = f"http://127.0.0.1:{port}"
    prompts, sampling = [[1, 5, 6], [1, 7]], Sampling(n=2, max_tokens=8, seed=0)
    server = serve_replica(node1, port)
    base = node1 / "cpu_tiny" / "base_model"  # what `serve-replica` serves (it builds it)
    try:
        remote = functools.partial(ReplicaPool, ReplicaSpec(model=str(base)), urls=[url], key=TOKEN, request_timeout_s=60)
        with remote(max_failures=0, start_timeout_s=300) as strict, \
                remote(max_failures=1, start_timeout_s=5) as patient, \
                remote(max_failures=1, start_timeout_s=300) as pool:
            for p in (strict, patient, pool):
                records = p.generate(prompts, sampling)
                assert len(records) == 4 and {(r.replica_id, r.policy_version) for r in records} == {(0, 0)}
            assert pool.pids() == [None]  # not started by the pool
            kill_group(server)

            t0 = time.monotonic()
            with pytest.raises(PoolError, match=r"replica 0 failed 1 times \(max_failures=0\)"):
                strict.generate(prompts, sampling)
            assert time.monotonic() - t0 < 10
            assert not restart_threads()  # over budget: nothing keeps waiting for the server

            t0 = time.monotonic()
            with pytest.raises(PoolError, match=rf"max_failures=1\) {url} did not answer again"):
                patient.generate(prompts, sampling)
            assert 5 <= time.monotonic() - t0 < 30  # start_timeout_s, + one /health timeout at most

            assert pool.health_check()[0]["up"] is False  # the loss is noticed; the pool waits for the server
            server = serve_replica(node1, port)  # node 1 starts it again (same port, its base model)
            stale = pool.replicas_needing_weights()  # waits for it to answer
            assert [(r.replica_id, r.version, r.weights_ok) for r in stale] == [(0, 0, False)]
            with pytest.raises(TimeoutError, match="unfinished"):
                pool.generate(prompts, sampling, timeout_s=3)  # not fresh: no work before the push
            assert pool.begin_update([0], "between_batches", timeout_s=60) == [0]  # a re-sync, as the learner's
            with HostMemorySender(pool.urls, pool.key, timeout_s=60, bucket_bytes=1 << 20) as sender:
                assert sender.push(iter(state_dict(base).items())).failed == {}
            assert pool.finish_update(1, [0]) == [0]
            assert pool.replicas_needing_weights() == []
            records = pool.generate(prompts, sampling)
            assert len(records) == 4 and {r.policy_version for r in records} == {1}
    finally:
        kill_group(server)
    deadline = time.monotonic() + 10
    while restart_threads():  # stopped pools: their idle restart threads exit, none is left waiting
        assert time.monotonic() < deadline, restart_threads()
        time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.slow
def test_dedicated_replica_node_job(tmp_path):
    """Node 1: `serve-replica --index 0` (vLLM's server, serving the base model); node 0: a torchrun
    learner with PP=2 (two weight senders) whose pool uses that server's URL."""
    from megatron_async.learner.parallel import free_port
    from megatron_async.rollout import ReplicaClient

    port, master = free_port(), free_port()
    data = coin_flip_data(tmp_path)  # reward spread: a learning signal (e2e_utils.assert_trained)
    server = serve_replica(tmp_path / "node1", port, *data, *LOCAL_DEDICATED)
    learner_dir = tmp_path / "node0"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={master}", "-m", "megatron_async", "train", CFG, *SMALL,
           *data, *LOCAL_DEDICATED, "parallel.pp=2", f"rollout.base_port={port}", f"run.out_dir={learner_dir}"]
    learner_dir.mkdir()
    with open(learner_dir / "learner.log", "w") as log:
        learner = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        code = learner.wait(timeout=600)
        alive = server.poll() is None
        served = ReplicaClient(f"http://127.0.0.1:{port}", TOKEN, timeout_s=10).version(default=-1) if alive else None
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
        kill_group(server)  # the server outlives the learner (on a real replica node, srun ends it)
    logs = [(learner_dir / "learner.log").read_text(), (tmp_path / "node1" / "serve.log").read_text()]
    assert code == 0 and alive, f"exit code {code}, server alive {alive}:\n{logs[0][-4000:]}\n----- node 1\n{logs[1][-3000:]}"

    run_dir = learner_dir / "cpu_tiny"
    assert_trained(run_dir, STEPS)
    m = metrics(run_dir)
    # one step off-policy: batch s was generated by version max(0, s - 1) on node 1's server, so the
    # weights of versions 1.. reached it from both pipeline stages' senders
    assert_one_step_off_policy(m, STEPS)
    # version 0 is the SFT'd model, not the base model the server started with: the learner pushed it
    # before training, and the PP=2 learner and vLLM agree on its logprobs
    assert m["logprob_diff/learner_vs_generator"][0] < 1e-3
    versions = lambda tag: {r["policy_version"] for r in json.loads((run_dir / f"eval_{tag}.json").read_text())["results"]}  # noqa: E731
    assert versions("before") == {0} and versions("after") == {STEPS}
    assert served == STEPS  # node 1's server holds the learner's final version
    assert re.search(rf"replicas: http://127\.0\.0\.1:{port} \(pids \[None\]\)", logs[0]), logs[0][-3000:]
    assert not (run_dir / "replicas").exists()  # no replica was started on the learner's side
    # the run plan: rank 0's, saved beside config.yaml; node 1's run folder had none, so serve-replica planned there
    plan = load_plan(run_dir)
    assert plan is not None and (plan.model_dtype, plan.weight_engine, plan.sync_full_every) == ("float32", "mas_cpu", 0)
    assert f"planned here: {plan.describe().split(';')[0]}" in logs[1], logs[1][-3000:]
