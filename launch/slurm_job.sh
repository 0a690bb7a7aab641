# What both SLURM scripts (slurm_llama8b.sbatch, slurm_llama70b.sbatch) do around their job step.
# Each function says what it reads and what it sets.
source launch/gpu_env.sh  # load_stop_plan

# The job network: JOB_IFNAME (set once at the top of each script) names the interface the nodes
# reach each other on. NCCL's socket transport, gloo (the trainer's control group, megatron's gloo
# groups) and the replica servers' address all use it, so none is left to name resolution.
# Usage: use_job_network REPLICA_NODE   sets NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, REPLICA_HOST
use_job_network() {
    local node=$1 addr
    export NCCL_SOCKET_IFNAME=$JOB_IFNAME GLOO_SOCKET_IFNAME=$JOB_IFNAME
    if [[ -z ${REPLICA_HOST:-} ]]; then
        addr=$(srun --nodes=1 --ntasks=1 -w "$node" ip -4 -o addr show dev "$JOB_IFNAME" | awk '{print $4}' | cut -d/ -f1 | head -n 1) || addr=
        [[ -n $addr ]] || { echo "[slurm] no IPv4 address on interface JOB_IFNAME=$JOB_IFNAME on $node: set JOB_IFNAME to the job network's interface (ip -4 addr shows them)" >&2; exit 2; }
        export REPLICA_HOST=$addr
    fi
    echo "[slurm] job network: $JOB_IFNAME (NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME); replicas at $REPLICA_HOST"
}

# A requeued job (SLURM_RESTART_COUNT > 0) resumes only from a checkpoint that exists
# (LATEST_CHECKPOINT, from load_stop_plan); with none saved yet it starts fresh, saying so.
# Usage: resume_args   sets RESUME_ARGS (empty, or run.resume=true)
resume_args() {
    RESUME_ARGS=()
    [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]] || return 0
    if [[ -n $LATEST_CHECKPOINT ]]; then
        RESUME_ARGS=(run.resume=true)
        echo "[slurm] requeued (restart $SLURM_RESTART_COUNT): resuming from $LATEST_CHECKPOINT"
    else
        echo "[slurm] requeued (restart $SLURM_RESTART_COUNT): no checkpoint in $RUN_DIR/checkpoints yet, starting fresh"
    fi
}

# SLURM's warning before the time limit, armed by the job itself: `#SBATCH --signal` cannot read the
# config, so a background timer sends USR1 to this script STOP_WARNING_S (run.stop_deadline_s + 60 s,
# from load_stop_plan) before the job's end time, re-reading that end time when it wakes (an
# extended time limit moves it). check_stop_fits before the job step starts (a time limit shorter
# than the stop is refused in one line), arm_stop_warning once it runs (sets WARNING_PID).
check_stop_fits() {
    local end left
    if ! end=$(job_end_epoch); then
        echo "[slurm] the job has no end time (squeue: $end): no stop warning will be armed" >&2
        return 0
    fi
    left=$((end - $(date +%s)))
    if ((left <= STOP_WARNING_S)); then
        echo "[slurm] the job's ${left} s leave no room for its stop (STOP_WARNING_S=${STOP_WARNING_S}, from run.stop_deadline_s=${STOP_DEADLINE_S} + 60 s): raise --time or lower the deadline" >&2
        exit 2
    fi
    echo "[slurm] stop warning: USR1 ${STOP_WARNING_S} s before the time limit (run.stop_deadline_s=${STOP_DEADLINE_S} + 60 s), in $((left - STOP_WARNING_S)) s"
}

arm_stop_warning() {
    job_end_epoch >/dev/null || return 0
    (
        sleeper=
        trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM  # the job ended first: no sleep outlives it
        while true; do
            if end=$(job_end_epoch); then
                wait_s=$((end - STOP_WARNING_S - $(date +%s)))
                ((wait_s > 0)) || break
            else
                wait_s=60  # squeue did not answer: ask again, never warn early
            fi
            sleep "$wait_s" & sleeper=$!
            wait "$sleeper"
        done
        kill -USR1 $$
    ) &
    WARNING_PID=$!
}

# The job's end time in seconds since the epoch (squeue's %e), or a non-zero status (UNLIMITED, NONE).
job_end_epoch() {
    local end
    end=$(squeue -h -j "$SLURM_JOB_ID" -o %e)
    date -d "$end" +%s 2>/dev/null || { echo "$end"; return 1; }
}
