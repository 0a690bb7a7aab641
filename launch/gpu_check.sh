#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA (one GPU is enough; a few minutes after install):
# Transformer Engine layer spec, bf16 + DistributedOptimizer, NCCL TP=2 vs TP=1, and the NCCL weight
# sync learner GPU -> vLLM replica (tests/test_gpu_sync.py, needs 2 GPUs) (tests marked `gpu`).
#
#   EXTRAS=gpu,test bash launch/gpu_check.sh
#
# Without CUDA every `gpu` test skips with its reason, so this is safe to run anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS:-gpu,test} bash launch/install.sh
exec .venv/bin/python -m pytest -m gpu -q -ra "$@"
