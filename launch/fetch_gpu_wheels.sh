#!/usr/bin/env bash
# Step 1 of the GPU check, the step before `launch/gpu_check.sh`: download, where PyPI is reachable,
# the wheels gpu_check.sh installs offline on the lent GPU machine (Python 3.12, torch 2.11 +
# transformers + pytest preinstalled; no megatron-core, no network): into .whl/ (git-ignored; carried
# to the machine with the working tree, 64 MiB at most in all). Without them the check's learner
# phases fail for want of megatron-core.
#
#   bash launch/fetch_gpu_wheels.sh            # step 1, here
#   bash launch/gpu_check.sh                   # step 2, on the GPU machine: one archive + one summary in $OUT
#
# --no-deps: only what the machine lacks and the checks import. megatron-core 0.16.1 itself needs
# torch, numpy and packaging, all there already. Not fetched, because they do not fit: vLLM (336 MB,
# pins another torch) and Transformer Engine (core wheels 276-729 MB, torch extension sdist-only);
# gpu_check.sh skips their phases with that reason. mlflow is not needed by any GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
  megatron-core==0.16.1   # cp312 manylinux wheel, ~2.6 MB
)
mkdir -p .whl
"$PY" -m pip download --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
  -d .whl "${WHEELS[@]}"
ls -l .whl
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "[fetch_gpu_wheels] $(ls .whl/*.whl | wc -l) wheels, $(( total / 1024 / 1024 )) MiB in .whl/ (limit 64 MiB)"
(( total < 64 * 1024 * 1024 )) || { echo "[fetch_gpu_wheels] over the 64 MiB the device check can carry" >&2; exit 1; }
