# Environment for GPU jobs, sourced by single_node.sh, multi_node.sh and the SLURM scripts.
# Every value can be overridden by exporting it before the launch; each line says why it is set.
# (No secrets here: the replica token travels in MEGATRON_ASYNC_ROLLOUT_TOKEN, never on a command
# line, because command lines are world-readable in `ps`.)

# Megatron overlaps TP communication with compute only if kernels reach the GPU in issue order,
# i.e. over one hardware work queue; megatron-core warns without it.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# Network interface for NCCL's bootstrap/socket transport AND for gloo (the trainer's control
# group and megatron's gloo DP groups use gloo over TCP). Pick the interface that carries the
# nodes' addresses ("ib0", "eth0", "enp..."): a wrong default (docker0, lo) hangs at init.
# NCCL reads a prefix ("eth" = eth0, eth1...) or an exclusion ("^lo,docker"); gloo needs one exact
# name, so it follows NCCL only when NCCL's value is an exact name: best set both, e.g. to "ib0".
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
if [[ -z ${GLOO_SOCKET_IFNAME:-} && $NCCL_SOCKET_IFNAME != ^* && $NCCL_SOCKET_IFNAME != *,* ]]; then
    export GLOO_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME#=}
fi

# InfiniBand / RoCE for inter-node collectives (TP x PP groups across nodes, DP all-reduce):
#  NCCL_IB_HCA      which HCAs, e.g. "mlx5" (all mlx5 ports) or "=mlx5_0:1,mlx5_1:1" (exact list)
#  NCCL_IB_GID_INDEX RoCE v2 needs the GID of the IPv4 address (3 on most clusters); IB needs none
#  NCCL_IB_DISABLE=1 forces TCP sockets (debugging only: ~10x slower)
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
[[ -n ${NCCL_IB_HCA:-} ]] && export NCCL_IB_HCA
[[ -n ${NCCL_IB_GID_INDEX:-} ]] && export NCCL_IB_GID_INDEX

# A rank that dies makes the others' collectives fail (and the job end) instead of hanging until
# the 30-minute process-group timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# WARN prints only problems; INFO shows the chosen transports (NET/IB vs NET/Socket) when tuning.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# CPU threads per learner rank (torch) and per replica; torchrun otherwise sets 1.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1  # rank logs appear as they happen in SLURM output files

# Number of CUDA devices this node shows us (respects CUDA_VISIBLE_DEVICES).
gpus_on_node() {
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    else
        nvidia-smi -L | grep -c '^GPU'
    fi
}

# megatron-async placement prints NPROC_PER_NODE, LEARNER_GPUS, REPLICA_GPUS, WORLD_SIZE for one
# node, after checking that the whole layout fits (a misfit stops here, before any launch).
# Usage: load_placement NODE_RANK CONFIG [overrides...]
load_placement() {
    local node_rank=$1; shift
    local layout
    layout=$("${VENV:-.venv}/bin/megatron-async" placement --node-rank "$node_rank" "$@")
    eval "$layout"
}

# megatron-async torchrun-args prints TORCHRUN_ARGS, the arguments of python that start this node's
# learner ranks under torchrun: written once (run/torchrun.py) for these scripts and our own relaunch,
# with the stop flags derived from run.stop_deadline_s (torchrun forwards SIGUSR1 too: SLURM's warning,
# each rank saves a checkpoint and exits 75, run/stop.py; it waits for that before it kills them).
# Usage: load_torchrun_args CONFIG [overrides...] --nproc-per-node N [--nnodes N --node-rank R --master-addr A --master-port P]
load_torchrun_args() {
    local args
    args=$("${VENV:-.venv}/bin/megatron-async" torchrun-args "$@")
    eval "$args"
}

# megatron-async stop-plan prints the stop budget every launcher derives from run.stop_deadline_s
# (STOP_DEADLINE_S, STOP_WARNING_S for SLURM; torchrun's --shutdown-timeout is in TORCHRUN_ARGS) and LATEST_CHECKPOINT
# (empty: nothing saved yet), from the config with its overrides: raise the deadline there, nowhere else.
# Usage: load_stop_plan CONFIG [overrides...]
load_stop_plan() {
    local plan
    plan=$("${VENV:-.venv}/bin/megatron-async" stop-plan "$@")
    eval "$plan"
}
