"""megatron_async: asynchronous RLHF with a Megatron-core learner and vLLM replicas."""
__version__ = "0.1.0"
