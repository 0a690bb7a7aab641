"""Model and tokenizer builders: the run's base model and tokenizer (`base_model`), tiny
LLaMA-family models made in code (`tiny`) and SmolLM2-135M-Instruct from an offline package
(`smollm2`); none needs a download."""
