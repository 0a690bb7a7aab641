#!/usr/bin/env bash
# One GPU node: learner ranks on some GPUs, vLLM replicas on the others.
#
#   bash launch/single_node.sh configs/gpu_rho1b_gsm8k.yaml [section.key=value ...]
#   CUDA_VISIBLE_DEVICES=0,1,2,3 bash launch/single_node.sh CONFIG      # use 4 of the GPUs
#
# The split comes from the config (placement.*, rollout.num_replicas, rollout.replica_tp):
# by default ("auto") the last num_replicas x replica_tp GPUs run the replicas and every other GPU
# runs one learner rank; set placement.learner_gpus / placement.replica_gpus for another split.
# torchrun starts the learner ranks; learner rank 0 starts the replicas as its subprocesses, each
# with CUDA_VISIBLE_DEVICES = its own GPUs (vLLM's own tensor parallelism when replica_tp > 1).
# GPU ids are indices within CUDA_VISIBLE_DEVICES when it is set. Runs from ${VENV:-.venv} (the GPU
# stack installed with `VENV=.venv-gpu EXTRAS=gpu,test bash launch/install.sh`: VENV=.venv-gpu here too).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "usage: $0 CONFIG [section.key=value ...]" >&2; exit 2; }
CONFIG=$1; shift
source launch/gpu_env.sh

GPUS=$(gpus_on_node)
ARGS=("$CONFIG" placement.nnodes=1 "placement.gpus_per_node=$GPUS" "$@")
load_placement 0 "${ARGS[@]}"   # sets NPROC_PER_NODE, LEARNER_GPUS, REPLICA_GPUS, WORLD_SIZE
echo "[single_node] $GPUS GPUs: learner ranks on GPUs $LEARNER_GPUS, replicas on GPUs $REPLICA_GPUS"

# The rendezvous on 127.0.0.1 at a free port (no MASTER_ADDR/PORT needed).
load_torchrun_args "${ARGS[@]}" --nproc-per-node "$NPROC_PER_NODE"
exec "${VENV:-.venv}/bin/python" "${TORCHRUN_ARGS[@]}"
