#!/usr/bin/env bash
# One prepared GPU benchmark (one H200, <= 8 minutes): learner step time / MFU / memory, vLLM
# tokens/s and weight-sync seconds (with vLLM), the async/sync speedup (with vLLM and 2 GPUs), for a
# ~0.89B LLaMA built in code (no downloads). Prints one JSON summary line; each phase's JSON in
# runs/gpu_bench/. See tools/gpu/gpu_bench.py (NOT yet run on a GPU:
# written on a CPU-only machine). GPU_BENCH_SMOKE=1 runs the same path on CPU with a tiny model.
set -euo pipefail
cd "$(dirname "$0")/../.."
# ${VENV:-.venv} when there is one (launch/install.sh), else the machine's python3 (e.g. the lent GPU machine,
# with megatron-core from .whl/ as launch/gpu_check.sh installs it; the project from the working tree).
PY=${PYTHON:-$([[ -x ${VENV:-.venv}/bin/python ]] && echo "${VENV:-.venv}/bin/python" || echo python3)}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
[[ -d .gpu_site ]] && export PYTHONPATH="$(pwd)/.gpu_site:$PYTHONPATH"  # left by launch/gpu_check.sh
exec timeout --signal=TERM --kill-after=10 480 "$PY" tools/gpu/gpu_bench.py "$@"
