"""The megatron-core learner: parallel set-up (`parallel`), CPU shims (`cpu_shims`), GPTModel from
an HF config (`model`), PPO's value model (`value`), logprobs, values and losses through the
pipeline schedule (`logprobs`), Adam + LR schedule (`optimizer`) and atomic checkpoints
(`checkpoint`). See each module's docstring."""
