#!/usr/bin/env bash
# Install everything into .venv (first run: ~5-8 min) and run the test suite with the real vLLM and
# megatron-core on CPU. Extra arguments go to pytest, e.g. `bash launch/test.sh -k config -x`.
# Tests marked `gpu` skip themselves without CUDA; run them with `bash launch/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/python -m pytest "$@"
