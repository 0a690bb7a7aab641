#!/usr/bin/env bash
# The CPU main job on a fresh machine: install into .venv, then asynchronous Online DPO on a tiny
# LLaMA built in code (real vLLM replica + real megatron-core learner, MLflow in the run folder).
# Extra arguments are config overrides, e.g. `bash launch/quickstart.sh trainer.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/megatron-async train configs/cpu_tiny.yaml "$@"
