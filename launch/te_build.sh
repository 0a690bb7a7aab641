# Sourced by launch/install.sh before it builds Transformer Engine's torch extension (and by
# tests/test_launch.py): functions only, no side effects.

# nvcc_cuda_version "$(nvcc --version)" -> "12.8": the toolkit's CUDA version (empty if not found).
nvcc_cuda_version() {
  sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<<"$1" | head -n 1
}

# check_te_toolkit NVCC_CUDA TORCH_CUDA: status 0 when the CUDA majors match; else 1 and why on
# stdout. torch's extension builder (torch/utils/cpp_extension.py, _check_cuda_version) raises on a
# different CUDA major between nvcc and torch.version.cuda, deep inside pip, after the TE download.
check_te_toolkit() {
  local nvcc=$1 torch=$2
  if [[ -z $nvcc ]]; then
    echo "could not read the CUDA version from \`nvcc --version\` (no \"release X.Y\" in its output); set CUDA_HOME to a CUDA ${torch%%.*} toolkit or set WITH_TE=0"
    return 1
  fi
  if [[ ${nvcc%%.*} != "${torch%%.*}" ]]; then
    echo "nvcc is CUDA $nvcc but the installed torch was built with CUDA $torch: Transformer Engine's torch extension cannot be built across CUDA majors (torch refuses it); install a CUDA ${torch%%.*} toolkit (and set CUDA_HOME to it) or set WITH_TE=0"
    return 1
  fi
}

# te_max_jobs NPROC MEM_AVAILABLE_KB -> parallel compile jobs: one per CPU, at most one per 4 GiB
# of available memory (each nvcc job of TE's build can take a few GiB), at least 1.
te_max_jobs() {
  local by_mem=$(( $2 / (4 * 1024 * 1024) ))
  local jobs=$(( $1 < by_mem ? $1 : by_mem ))
  echo $(( jobs < 1 ? 1 : jobs ))
}
