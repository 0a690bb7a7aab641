#!/usr/bin/env bash
# Several GPU nodes: run this once on EVERY node of the job (the SLURM scripts do it with srun).
#
#   # on node 0 (it hosts the vLLM replicas and learner rank 0):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch/multi_node.sh CONFIG [overrides]
#   # on node 1:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch/multi_node.sh CONFIG [overrides]
#
# Variables:
#   NNODES        nodes in the job (= placement.nnodes; passed on as that override)
#   NODE_RANK     this node's rank, 0..NNODES-1. Node 0 hosts the replicas (placement.replica_node)
#   MASTER_ADDR   address of node 0, reachable from every node (the torchrun rendezvous store and the
#                 torch.distributed TCP store live there)
#   MASTER_PORT   a free TCP port on node 0, the same on every node (default 29500)
#   REPLICA_HOST  node 0's address for the replica endpoints (-> rollout.host). Needed when a
#                 pipeline stage's weight-sync sender runs on another node (PP across nodes);
#                 `megatron-async placement` says so. Then MEGATRON_ASYNC_ROLLOUT_TOKEN must hold
#                 the shared secret (same on all nodes; only rank 0 uses it).
#   REPLICA_BASE_PORT  fixed ports for the replicas (-> rollout.base_port) when a firewall needs them
#   GPUS_PER_NODE default: the GPUs this node shows
#
# Rendezvous: static (--node-rank, --master-addr/--master-port), not c10d. Node 0 must be the node
# with rank 0 (which starts the replicas), and with placement "auto" node 0 runs fewer learner
# ranks than the others (its replica GPUs are not learner GPUs); a c10d rendezvous hands out node
# ranks in arrival order, so a node could not know its --nproc-per-node before joining.
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
load_placement "$NODE_RANK" "${ARGS[@]}"   # NPROC_PER_NODE, LEARNER_GPUS, REPLICA_GPUS, WORLD_SIZE
echo "[multi_node] node $NODE_RANK/$NNODES ($(hostname)): $NPROC_PER_NODE learner ranks on GPUs $LEARNER_GPUS;" \
     "replica GPUs: ${REPLICA_GPUS:-none}; $WORLD_SIZE learner ranks in the job"

exec .venv/bin/python -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" \
    --nproc-per-node="$NPROC_PER_NODE" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m megatron_async train "${ARGS[@]}"
