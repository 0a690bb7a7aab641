#!/usr/bin/env bash
# Several GPU nodes: run this once on EVERY node of the job (the SLURM scripts do it with srun).
#
#   # on node 0 (it hosts the vLLM replicas and learner rank 0):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch/multi_node.sh CONFIG [overrides]
#   # on node 1:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch/multi_node.sh CONFIG [overrides]
#
# With a dedicated replica node (placement.dedicated_replica_node=true placement.replica_node=R)
# node R runs no torchrun (`megatron-async placement` gives it NPROC_PER_NODE=0) but one
# `megatron-async serve-replica --index i` per replica: replica i's vLLM server on its own GPUs at
# REPLICA_HOST:REPLICA_BASE_PORT + i, which learner rank 0 uses as its replicas' URLs. torchrun
# spans the other NNODES - 1 nodes; MASTER_ADDR is then the first learner node (node 0, or node 1
# if R = 0).
#
# Variables:
#   NNODES        nodes in the job (= placement.nnodes; passed on as that override)
#   NODE_RANK     this node's rank, 0..NNODES-1 (placement numbering: the replica node counts)
#   MASTER_ADDR   address of the first learner node, reachable from every node (the torchrun
#                 rendezvous store and the torch.distributed TCP store live there)
#   MASTER_PORT   a free TCP port on that node, the same on every node (default 29500)
#   REPLICA_HOST  the replica node's address for the replica endpoints (-> rollout.host). Needed
#                 when a weight-sync sender (one per pipeline stage) runs on another node, always
#                 with a dedicated replica node; `megatron-async placement` says so. Then
#                 MEGATRON_ASYNC_ROLLOUT_TOKEN must hold the shared secret (same on all nodes).
#   REPLICA_BASE_PORT  replica i listens on this + i (-> rollout.base_port): required with a
#                 dedicated replica node, else only when a firewall needs fixed ports
#   GPUS_PER_NODE default: the GPUs this node shows
#   VENV          the virtual environment to run from (default .venv; the GPU stack: VENV=.venv-gpu,
#                 as launch/install.sh was given)
#
# Rendezvous: static (--node-rank, --master-addr/--master-port), not c10d. The first learner node
# must be the node with rank 0 (which owns the replica pool), and with placement "auto" a shared
# replica node runs fewer learner ranks than the others (its replica GPUs are not learner GPUs);
# a c10d rendezvous hands out node ranks in arrival order, so a node could not know its
# --nproc-per-node before joining.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: NNODES=.. NODE_RANK=.. MASTER_ADDR=.. $0 CONFIG [overrides]" >&2; exit 2; }
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=$1; shift
source launch/gpu_env.sh

GPUS=${GPUS_PER_NODE:-$(gpus_on_node)}
ARGS=("$CONFIG" "placement.nnodes=$NNODES" "placement.gpus_per_node=$GPUS")
[[ -n ${REPLICA_HOST:-} ]] && ARGS+=("rollout.host=$REPLICA_HOST")
[[ -n ${REPLICA_BASE_PORT:-} ]] && ARGS+=("rollout.base_port=$REPLICA_BASE_PORT")
ARGS+=("$@")
# NPROC_PER_NODE, LEARNER_GPUS, REPLICA_GPUS, WORLD_SIZE, TORCHRUN_NNODES, TORCHRUN_NODE_RANK, NUM_REPLICAS
load_placement "$NODE_RANK" "${ARGS[@]}"
echo "[multi_node] node $NODE_RANK/$NNODES ($(hostname)): $NPROC_PER_NODE learner ranks on GPUs $LEARNER_GPUS;" \
     "replica GPUs: ${REPLICA_GPUS:-none}; $WORLD_SIZE learner ranks in the job"

if [[ $NPROC_PER_NODE == 0 ]]; then
    # A dedicated replica node: every replica's server in the background (each takes its own GPUs
    # from the placement), then wait for all (non-zero if any failed). They serve the base model
    # until the learner pushes its weights, and outlive the learner: stop them with SIGTERM (passed
    # on to every server), or let srun --wait end them (the SLURM scripts).
    pids=()
    trap 'kill -TERM "${pids[@]}" 2>/dev/null' INT TERM
    trap '' USR1  # the learner's save-and-stop warning: the servers (which inherit this) serve on until it closes
    for ((i = 0; i < NUM_REPLICAS; i++)); do
        "${VENV:-.venv}/bin/megatron-async" serve-replica "${ARGS[@]}" --index "$i" &
        pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    wait  # after a signal: until every server has stopped
    exit "$rc"
fi
load_torchrun_args "${ARGS[@]}" --nproc-per-node "$NPROC_PER_NODE" --nnodes "$TORCHRUN_NNODES" \
    --node-rank "$TORCHRUN_NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
exec "${VENV:-.venv}/bin/python" "${TORCHRUN_ARGS[@]}"
