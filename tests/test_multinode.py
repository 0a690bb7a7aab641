"""Multi-node launch and placement.

The slow test runs a two-"node" job on this machine the way `launch/multi_node.sh` does on real
nodes: two torchrun agents (`--nnodes=2 --node-rank={0,1}`, static rendezvous on 127.0.0.1, gloo),
one learner rank each, `parallel.tp=2` so the tensor-parallel group spans both nodes, and the vLLM
replica started by node 0's rank 0. The other tests check the placement config (GPU splits,
fits, reachability of loopback replicas) without GPUs, by giving `placement.gpus_per_node`.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async.config import ConfigError, load_config
from megatron_async.placement import check_fit, node_layout
from tests.e2e_utils import RLOO
from tests.e2e_utils import SMALL as E2E_SMALL

REPO = Path(__file__).resolve().parents[1]
CFG = str(REPO / "configs" / "cpu_tiny.yaml")
STEPS = 3
SMALL = [*E2E_SMALL, *RLOO, "sft.steps=20", f"trainer.steps={STEPS}", "trainer.checkpoint_every=0",
         "rollout.max_new_tokens=32"]  # later overrides win


def gpu_cfg(*overrides):
    """A config as a login node would validate it before launch: 8 GPUs per node, no CUDA here."""
    return load_config(CFG, ["placement.gpus_per_node=8", *overrides])


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
    (["placement.nnodes=2", "placement.replica_node=1"], "placement.replica_node", "only 0 is supported"),
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
    load_config(CFG, ["placement.learner_gpus=[0,1,2,3]", "placement.replica_gpus=[4]", "parallel.world_size=2"])


def test_placement_command_prints_each_nodes_nproc():
    base = [sys.executable, "-m", "megatron_async", "placement"]
    args = [CFG, "placement.nnodes=2", "placement.gpus_per_node=8", "rollout.num_replicas=2", "parallel.tp=2"]
    out = [subprocess.run([*base, "--node-rank", str(n), *args], capture_output=True, text=True, check=True).stdout
           for n in (0, 1)]
    assert "NPROC_PER_NODE=6\nLEARNER_GPUS=0,1,2,3,4,5\nREPLICA_GPUS=6,7\nWORLD_SIZE=14" in out[0]
    assert "NPROC_PER_NODE=8\n" in out[1] and "REPLICA_GPUS=\n" in out[1]


def test_train_refuses_a_node_count_torchrun_did_not_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_async", "train", CFG, "placement.nnodes=2",
                           f"run.out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "key 'placement.nnodes' = 2: torchrun started 1 node(s)" in proc.stderr
    assert not (tmp_path / "cpu_tiny").exists()  # refused before building anything


# ----------------------------------------------------------------------------- two nodes, end to end


def mlflow_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from the run's embedded MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
            for key in client.get_run(run_id).data.metrics}


@pytest.mark.slow
def test_two_node_job_tp_across_nodes(tmp_path):
    from megatron_async.learner.parallel import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "megatron_async", "train", CFG, *SMALL, "parallel.tp=2", "placement.nnodes=2",
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
    m = mlflow_metrics(run_dir)
    steps = list(range(STEPS))
    # one step off-policy across the two-node learner: batch s generated by version max(0, s - 1)
    assert [m["rollout/policy_version"][s] for s in steps] == [max(0, s - 1) for s in steps]
    assert [m["rollout/lag_max"][s] for s in steps] == [0.0] + [1.0] * (STEPS - 1)
    assert sorted(m["train/loss"]) == steps and sorted(m["timing/sync_s"]) == steps
    # step 0: the TP=2 learner split over two nodes and vLLM agree on version 0's logprobs
    assert m["logprob_diff/learner_vs_generator"][0] < 1e-3
    # rank 0 (which starts the replica) ran under node 0's agent; node 1's agent ran the other rank
    # (TP=2 over two agents of one rank each: the job cannot finish unless both took part)
    assert (run_dir / "replicas" / "replica0.log").exists()
    assert "[rank0]" in logs[0] and "[rank0]" not in logs[1]
    assert (run_dir / "hf_final" / "config.json").exists()
