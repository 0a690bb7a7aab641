#!/usr/bin/env bash
# Install everything into .venv (first run: ~5-8 min) and run the test suite with the real vLLM and
# megatron-core on CPU. Extra arguments go to pytest, e.g. `bash launch/test.sh -k config -x`.
# VENV and EXTRAS go to launch/install.sh, and the tests run in that VENV (default .venv), e.g.
# `VENV=.venv-gpu EXTRAS=gpu,test bash launch/test.sh -m gpu`.
#
# Tiers (markers in pytest.ini, applied and enforced in tests/conftest.py):
#   bash launch/test.sh -m "not integration"            fast tier: in-process unit tests (losses,
#       batching, algorithms, config, data, rewards, mapping, placement, producer with fakes);
#       starts no process (a test that does fails), < 2 min on 2 cores
#   bash launch/test.sh -m "integration and not slow"   component tests that start processes:
#       vLLM replicas, torchrun / megatron workers, an MLflow server, the reward-model worker, the CLI
#   bash launch/test.sh -m slow                         whole `megatron-async train` jobs (minutes each)
#   bash launch/test.sh                                 all but `recipe` (CI runs this; docs/measurements.md#ci)
#   bash launch/test.sh -m recipe                       the main job's shipped recipe end to end (~10 min):
#       left out of every run that names no -m (pytest.ini's addopts); run it before a change to
#       the main job's data, SFT, config or Online DPO lands
# Tests marked `gpu` skip themselves without CUDA; run them with `bash launch/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# matplotlib builds its font cache on first use by running fc-list, a process, which the fast tier
# forbids inside a test: build it here, once per machine, before the tests start.
"${VENV:-.venv}/bin/python" -c "import matplotlib.font_manager"
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
