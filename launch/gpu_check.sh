#!/usr/bin/env bash
# One device check for a CUDA machine, offline, in under 8 minutes: a JSON file per phase, each
# phase under its own `timeout`, all of them handed back as ONE archive and ONE summary file.
#
# Step 1, before this script, once, where PyPI is reachable (the GPU machine has no network):
#   bash launch/fetch_gpu_wheels.sh               # megatron-core's wheel into .whl/ (ignored, carried along)
# Step 2, on the GPU machine:
#   bash launch/gpu_check.sh [OUT_DIR]            # OUT_DIR default: $OUT, else runs/gpu_check
#   bash launch/gpu_check.sh --dry-run OUT_DIR    # any machine, CPU is fine: every phase's code path at tiny
#                                                 # sizes (tests/test_gpu_check.py runs it in CI)
#
# What comes back: OUT_DIR holds exactly two files, gpu_check.tar.gz (every file the phases wrote:
# <phase>.json, per-test reports, benchmark folders, install.log, exit_codes.txt, under gpu_check/)
# and summary.json (each phase's status, reason or error, seconds, exit code; "pending" for one not
# ended), both rewritten atomically after every phase (tools/gpu_check_pack.py): the lent machine
# hands back at most 8 files of $OUT, and a run cut short hands back the phases that ended. The
# phases write into GPU_CHECK_WORK (default: a fresh folder under $TMPDIR), never into OUT_DIR.
#   tar -xzf OUT_DIR/gpu_check.tar.gz             # -> gpu_check/env.json, gpu_check/gpu_tests.json, ...
#
# Written for the lent machine: Python 3.12 + torch 2.11 (CUDA) + transformers + pytest preinstalled,
# no vLLM, TE, megatron-core or mlflow, no network. What it lacks comes from .whl/ (carried in with
# the working tree, <= 64 MiB): `python3 -m pip install --no-index --no-deps --target .gpu_site`.
# Why --target rather than a venv with --system-site-packages: nothing of the machine's Python is
# touched or shadowed (its torch stays exactly the preinstalled build, no pip resolution runs at
# all), the folder is thrown away with the working copy, and PYTHONPATH carries it to every
# subprocess (tests/dist prepends to PYTHONPATH instead of replacing it). The project itself is
# used from the working tree (PYTHONPATH), not installed.
#
# Phases (tools/gpu_check.py; gpu_check/<phase>.json says ok / skipped + reason / failed + error):
#   env            GPU, driver, torch, CUDA, cuDNN, NCCL versions; packages and where they come from;
#                  torch.compile's toolchain (a C compiler, Python.h) and a one-line torch.compile smoke
#   fork_probe     does torch.cuda.is_available() poison a later fork (vLLM forks workers), with and
#                  without PYTORCH_NVML_BASED_CUDA_CHECK=1 (no vLLM needed)
#   gpu_tests      `pytest -m gpu` over tests/ (collected without mlflow/vLLM) minus the vLLM module:
#                  bf16 + DistributedOptimizer, NaN guard, checkpoint round trip, HF export, parity.
#                  Each outcome is written as its test ends (tools/gpu_check_report.py), so a run cut
#                  short by its budget keeps the tests that passed; if the torch.compile smoke failed,
#                  the failed tests run again with TORCH_COMPILE_DISABLE=1
#   learner_bench  ~0.89B LLaMA, TP=1, bf16: step time, tokens/s, MFU, memory by component vs
#                  docs/scaling.md (tools/gpu/gpu_bench.py learner)
#   weights_bench  weights/host_memory.py's bucket packing and checksums of GPU tensors (GB/s)
#   weight_wire    bf16 GPU tensors to a CPU receiver process over both weight paths' sending ends:
#                  a /dev/shm bucket (the shm carrier) and the gloo wire's communicator; byte-equal
#   batch_prep     RLOO and PPO batch preparation on the GPU through megatron_async.algorithms
#   vllm           vLLM tokens/s on the GPU (skipped without vLLM; the NCCL weight sync is a gpu test)
#   te             the learner benchmark with the Transformer Engine spec (skipped without TE)
# Exit status: 0 when no phase failed (skips are fine), 1 otherwise; OUT_DIR/summary.json lists all.
# (No `set -e`: a failing phase must not stop the ones after it, nor the packing.)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=()
if [[ ${1:-} == --dry-run ]]; then DRY=(--dry-run); shift; fi
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK_DIR=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$WORK_DIR"
WORK_DIR=$(cd "$WORK_DIR" && pwd)
[[ $WORK_DIR == "$OUT_DIR" || $WORK_DIR == "$OUT_DIR"/* ]] && { echo "[gpu_check] GPU_CHECK_WORK must be outside $OUT_DIR" >&2; exit 2; }
rm -f "$OUT_DIR/gpu_check.tar.gz" "$OUT_DIR/summary.json"
echo "[gpu_check] phases write into $WORK_DIR; packed into $OUT_DIR/gpu_check.tar.gz + summary.json after each"
BUDGET_S=${GPU_CHECK_BUDGET_S:-430}  # the first seven phases together; vllm and te only run where installed
# A dry run checks code paths, not speed: its limits stretch so that a busy CI machine does not time out.
SCALE=${GPU_CHECK_TIMEOUT_SCALE:-$(( ${#DRY[@]} ? 4 : 1 ))}
BUDGET_S=$(( BUDGET_S * SCALE ))

if [[ ${#DRY[@]} -gt 0 ]]; then
  PY=${PYTHON:-$([[ -x ${VENV:-.venv}/bin/python ]] && echo "${VENV:-.venv}/bin/python" || echo python3)}
  # As on the lent GPU machine: these packages are absent (tests/hide_modules/sitecustomize.py).
  export MEGATRON_ASYNC_HIDE_MODULES=${MEGATRON_ASYNC_HIDE_MODULES:-mlflow,vllm,transformer_engine,datasets,rich,matplotlib,psutil,sentencepiece,accelerate,hypothesis}
  export PYTHONPATH="$REPO/tests/hide_modules${PYTHONPATH:+:$PYTHONPATH}"
else
  PY=${PYTHON:-python3}
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# Offline wheels (launch/fetch_gpu_wheels.sh) for what the machine lacks.
shopt -s nullglob
wheels=(.whl/*.whl)
if [[ ${#wheels[@]} -gt 0 && ${#DRY[@]} -eq 0 ]]; then  # (a dry run uses the venv's packages)
  echo "[gpu_check] installing ${#wheels[@]} wheels from .whl/ into .gpu_site (no index, no deps)"
  rm -rf .gpu_site
  if "$PY" -m pip install -q --no-index --no-deps --target .gpu_site "${wheels[@]}" > "$WORK_DIR/install.log" 2>&1; then
    export PYTHONPATH="$REPO/.gpu_site:$PYTHONPATH"
  elif "$PY" - .gpu_site "${wheels[@]}" >> "$WORK_DIR/install.log" 2>&1 <<'PY'
import sys, zipfile  # no pip: a wheel is a zip archive of its site-packages files
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
  then
    echo "[gpu_check] pip failed (see install.log): wheels unpacked into .gpu_site instead"
    export PYTHONPATH="$REPO/.gpu_site:$PYTHONPATH"
  else
    echo "[gpu_check] wheel install failed (see install.log); going on with what is installed"
  fi
fi

start=$(date +%s)
failed=0
rm -f "$WORK_DIR/exit_codes.txt"
pack() {  # everything under WORK_DIR -> OUT_DIR/gpu_check.tar.gz + OUT_DIR/summary.json
  "$PY" tools/gpu_check_pack.py --work "$WORK_DIR" --out "$OUT_DIR" --seconds "$(( $(date +%s) - start ))"
}
run_phase() {  # name, seconds
  local name=$1 limit=$(( $2 * SCALE )) left
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [[ $name == vllm || $name == te ]]; then left=$limit; fi  # extra time, only where they run at all
  (( limit > left )) && limit=$left
  rm -f "$WORK_DIR/$name.json"
  if (( limit < 10 )); then
    printf '{"phase": "%s", "status": "skipped", "reason": "no time left in the %s s budget"}\n' "$name" "$BUDGET_S" > "$WORK_DIR/$name.json"
    echo "[gpu_check] $name: skipped (no time left)"
    pack > /dev/null || echo "[gpu_check] packing after $name failed"
    return
  fi
  timeout --kill-after=10 "$limit" "$PY" tools/gpu_check.py "$name" --out "$WORK_DIR" --budget $(( limit - 8 )) "${DRY[@]}"
  local rc=$?
  if [[ ! -f $WORK_DIR/$name.json ]]; then
    local why="exited $rc without writing its JSON"
    (( rc == 124 || rc == 137 )) && why="timed out after $limit s"
    printf '{"phase": "%s", "status": "failed", "error": "%s"}\n' "$name" "$why" > "$WORK_DIR/$name.json"
    echo "[gpu_check] $name: failed ($why)"
  fi
  echo "$name $rc" >> "$WORK_DIR/exit_codes.txt"
  if (( rc != 0 )); then failed=1; echo "[gpu_check] $name exited $rc"; fi
  pack > /dev/null || echo "[gpu_check] packing after $name failed"
}

run_phase env 60  # 45 s of it for the torch.compile smoke (a first Triton compile)
run_phase fork_probe 45
run_phase gpu_tests 150
run_phase learner_bench 90
run_phase weights_bench 30
run_phase weight_wire 30
run_phase batch_prep 25
run_phase vllm 240
run_phase te 120

pack || failed=1  # prints the summary
exit $failed
