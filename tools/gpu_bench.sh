#!/usr/bin/env bash
# One prepared GPU benchmark (one H200, <= 8 minutes): learner MFU, vLLM tokens/s, weight-sync
# seconds and the async/sync speedup for a ~0.76B LLaMA built in code (no downloads). Prints one
# JSON summary line; details in runs/gpu_bench/. See tools/gpu_bench.py (NOT yet run on a GPU:
# written on a CPU-only machine). GPU_BENCH_SMOKE=1 runs the same path on CPU with a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec timeout --signal=TERM --kill-after=10 480 "$PY" tools/gpu_bench.py "$@"
