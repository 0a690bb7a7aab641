"""The megatron-core learner: parallel set-up (`parallel`), CPU shims (`cpu_shims`), GPTModel from
an HF config (`model`) with SDPA core attention (`attention`) and the LM head deferred to the loss
(`lm_head`), the GPU performance settings (`perf`), PPO's value model (`value`), the pass over
microbatches through megatron's pipeline schedule (`schedule`), logprobs from it (`logprobs`), Adam +
LR schedule (`optimizer`), atomic checkpoints (`checkpoint`), the one Megatron <-> HF tensor mapping
(`mapping`), HF <-> Megatron checkpoint conversion (`convert`) and the live model written as an HF
folder (`hf_export`). See each module's docstring."""
