"""Model and tokenizer builders that need no download (tiny LLaMA-family models made in code)."""
