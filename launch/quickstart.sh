#!/usr/bin/env bash
# The CPU main job on a fresh machine: install into ${VENV:-.venv} (launch/install.sh), then asynchronous Online DPO on a tiny
# LLaMA built in code (real vLLM replica + real megatron-core learner, MLflow in the run folder).
# Extra arguments are config overrides, e.g. `bash launch/quickstart.sh trainer.steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "${VENV:-.venv}/bin/megatron-async" train configs/cpu_tiny.yaml "$@"
