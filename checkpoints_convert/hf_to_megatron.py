"""HF safetensors checkpoint -> megatron_async learner checkpoint.

    python checkpoints_convert/hf_to_megatron.py HF_DIR CKPT_DIR --tp 2 --pp 2
"""
import sys

from megatron_async.learner.convert import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
