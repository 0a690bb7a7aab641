"""megatron_async learner checkpoint -> HF safetensors checkpoint (transformers / vLLM).

    python checkpoints_convert/megatron_to_hf.py CKPT_DIR HF_DIR [--tokenizer DIR] [--tp N --pp M]
"""
import sys

from megatron_async.learner.convert import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
